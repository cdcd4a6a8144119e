-- Delayed-delivery table of one queue for the SQL Server transport, as `throttlehost queues create`
-- and a host with create_queues = true create it: NServiceBus's layout and name, [<queue>.Delayed]
-- (transport.delayed_table_suffix), nonclustered Index_Due. Replace [dbo] and Sales.
-- Regenerate: cargo run --example print_ddl -- sqlserver-delayed dbo Sales
SET XACT_ABORT ON;
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'throttlehost_create_dbo', @LockMode = 'Exclusive', @LockOwner = 'Transaction';
IF SCHEMA_ID(N'dbo') IS NULL EXEC(N'CREATE SCHEMA [dbo]');
IF OBJECT_ID(N'[dbo].[Sales.Delayed]', N'U') IS NULL
BEGIN
    CREATE TABLE [dbo].[Sales.Delayed] (
        Headers nvarchar(max) NOT NULL,
        Body varbinary(max) NULL,
        Due datetime NOT NULL,
        RowVersion bigint IDENTITY(1,1) NOT NULL
    );
    CREATE NONCLUSTERED INDEX [Index_Due] ON [dbo].[Sales.Delayed] (Due);
END
COMMIT TRAN;
