-- Queue table for the PostgreSQL transport, as `throttlehost queues create` creates it
-- (NServiceBus PostgreSQL transport layout). Replace "public" and "Sales" with your schema and
-- queue name; quoted names keep their case. The host runs it under pg_advisory_xact_lock.
-- Regenerate: cargo run --example print_ddl -- postgres public Sales
CREATE SCHEMA IF NOT EXISTS "public";
CREATE TABLE IF NOT EXISTS "public"."Sales" (
    Id uuid NOT NULL PRIMARY KEY,
    Expires timestamp,
    Headers text NOT NULL,
    Body bytea,
    Seq serial NOT NULL UNIQUE
);
