-- Delayed-delivery table of one queue for the PostgreSQL transport, as `throttlehost queues create`
-- and a host with create_queues = true create it: NServiceBus's layout and name, "<queue>.Delayed"
-- (transport.delayed_table_suffix), index "<queue>.Delayed_Due". Replace "public" and "Sales".
-- Regenerate: cargo run --example print_ddl -- postgres-delayed public Sales
CREATE SCHEMA IF NOT EXISTS "public";
CREATE TABLE IF NOT EXISTS "public"."Sales.Delayed" (
    Id uuid NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
    Headers text NOT NULL,
    Body bytea,
    Due timestamptz NOT NULL
) WITH (fillfactor = 100);
CREATE INDEX IF NOT EXISTS "Sales.Delayed_Due" ON "public"."Sales.Delayed" (Due);
