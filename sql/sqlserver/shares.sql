-- The shares of fleet-wide limits in a schema (here [dbo]): one row per running host process
-- and queue with `concurrency.fleet_max`, saying how much of the limit the process wants and
-- holds. Each host takes its share in short transactions under an application lock per queue
-- (sp_getapplock), reading the others' rows and the instance registry (instances.sql) to tell
-- the living from the gone. The host creates the table when a queue has a fleet-wide limit,
-- under the schema's creation lock; run this instead when its login may not create tables (it
-- then needs INSERT, UPDATE, DELETE and SELECT).
SET XACT_ABORT ON;
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'throttlehost_create_dbo', @LockMode = 'Exclusive', @LockOwner = 'Transaction';
IF SCHEMA_ID(N'dbo') IS NULL EXEC(N'CREATE SCHEMA [dbo]');
IF OBJECT_ID(N'[dbo].[throttlehost_shares]', N'U') IS NULL
BEGIN
    CREATE TABLE [dbo].[throttlehost_shares] (
        queue nvarchar(400) NOT NULL,
        process_id uniqueidentifier NOT NULL,
        wanted int NOT NULL,
        granted int NOT NULL,
        updated_at datetime2 NOT NULL DEFAULT SYSUTCDATETIME(),
        PRIMARY KEY (queue, process_id)
    );
END
COMMIT TRAN;
