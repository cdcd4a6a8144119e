-- The instance registry of a schema (here [dbo]): one row per running host process, written
-- by its heartbeat (`[fleet]` in the host's configuration), read by `/fleet` and
-- `throttlehost status --fleet`, deleted when the process stops and, after
-- `fleet.forget_after`, by any instance for a process that stopped without saying so. The
-- host creates the table at start-up, under the schema's creation lock; run this instead
-- when its login may not create tables (it then needs INSERT, UPDATE, DELETE and SELECT).
SET XACT_ABORT ON;
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'throttlehost_create_dbo', @LockMode = 'Exclusive', @LockOwner = 'Transaction';
IF SCHEMA_ID(N'dbo') IS NULL EXEC(N'CREATE SCHEMA [dbo]');
IF OBJECT_ID(N'[dbo].[throttlehost_instances]', N'U') IS NULL
BEGIN
    CREATE TABLE [dbo].[throttlehost_instances] (
        process_id uniqueidentifier NOT NULL PRIMARY KEY,
        host_name nvarchar(400) NOT NULL,
        instance_id nvarchar(400) NOT NULL,
        version nvarchar(100) NOT NULL,
        admin_address nvarchar(400) NULL,
        summary nvarchar(max) NOT NULL,
        started_at datetime2 NOT NULL DEFAULT SYSUTCDATETIME(),
        last_seen datetime2 NOT NULL DEFAULT SYSUTCDATETIME()
    );
END
COMMIT TRAN;
