-- The held-keys table of a schema (here [dbo]), for ordered queues with
-- `[queues.ordering] failed_key = "hold"`. A keyed message that failed after its retries
-- stays in its queue; a row here, by queue table and message id, makes every ordered
-- receive pass it over (and its key, whose oldest message it is). `throttlehost queues held`
-- lists the rows, `throttlehost queues release` deletes them. The host creates the table at
-- start-up when a queue holds keys; run this instead when its login may not create tables.
IF OBJECT_ID(N'[dbo].[throttlehost_held]', N'U') IS NULL
CREATE TABLE [dbo].[throttlehost_held] (
    queue_table nvarchar(400) NOT NULL,
    message_id uniqueidentifier NOT NULL,
    [key] nvarchar(4000) NOT NULL,
    reason nvarchar(max) NOT NULL,
    held_at datetime2 NOT NULL DEFAULT SYSUTCDATETIME(),
    PRIMARY KEY (queue_table, message_id)
);
