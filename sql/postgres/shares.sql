-- The shares of fleet-wide limits in a schema (here "public"): one row per running host
-- process and queue with `concurrency.fleet_max`, saying how much of the limit the process
-- wants and holds. Each host takes its share in short transactions under an advisory lock per
-- queue, reading the others' rows and the instance registry (instances.sql) to tell the
-- living from the gone. The host creates the table when a queue has a fleet-wide limit; run
-- this instead when its account may not create tables (it then needs INSERT, UPDATE, DELETE
-- and SELECT on it).
CREATE SCHEMA IF NOT EXISTS "public";
CREATE TABLE IF NOT EXISTS "public"."throttlehost_shares" (
    queue text NOT NULL,
    process_id uuid NOT NULL,
    wanted integer NOT NULL,
    granted integer NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, process_id)
);
