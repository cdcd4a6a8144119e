-- Tables created by NServiceBus SQL Server transport versions before 4.3.2 / 5.0.3 / 6.0.1
-- have a CLUSTERED Index_RowVersion, which suffers page-latch contention at the head of the
-- queue under concurrent receivers. throttlehost warns about it at start-up. This recreates
-- the index as nonclustered (run in a maintenance window; the table is locked meanwhile).
-- Replace [dbo].[Sales] with the queue table.
BEGIN TRAN;
DROP INDEX Index_RowVersion ON [dbo].[Sales];
CREATE NONCLUSTERED INDEX Index_RowVersion ON [dbo].[Sales] (RowVersion);
COMMIT TRAN;

-- Headers stored as varchar lose characters outside the column's code page:
-- ALTER TABLE [dbo].[Sales] ALTER COLUMN Headers nvarchar(max) NOT NULL;
