-- Queue table for the SQL Server transport, as `throttlehost queues create` creates it
-- (NServiceBus SQL Server transport layout: a heap with a nonclustered Index_RowVersion and
-- a filtered Index_Expires). Replace [dbo] and Sales with your schema and queue name.
-- Regenerate: cargo run --example print_ddl -- sqlserver dbo Sales
SET XACT_ABORT ON;
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'throttlehost_create_dbo', @LockMode = 'Exclusive', @LockOwner = 'Transaction';
IF SCHEMA_ID(N'dbo') IS NULL EXEC(N'CREATE SCHEMA [dbo]');
IF NOT (OBJECT_ID(N'[dbo].[Sales]', N'U') IS NOT NULL)
BEGIN
    CREATE TABLE [dbo].[Sales] (
        Id uniqueidentifier NOT NULL,
        CorrelationId varchar(255) NULL,
        ReplyToAddress varchar(255) NULL,
        Recoverable bit NOT NULL,
        Expires datetime NULL,
        Headers nvarchar(max) NOT NULL,
        Body varbinary(max) NULL,
        RowVersion bigint IDENTITY(1,1) NOT NULL
    );
    CREATE NONCLUSTERED INDEX Index_RowVersion ON [dbo].[Sales] (RowVersion);
    CREATE NONCLUSTERED INDEX Index_Expires ON [dbo].[Sales] (Expires) INCLUDE (Id, RowVersion) WHERE Expires IS NOT NULL;
END
COMMIT TRAN;
