-- The instance registry of a schema (here "public"): one row per running host process,
-- written by its heartbeat (`[fleet]` in the host's configuration), read by `/fleet` and
-- `throttlehost status --fleet`, deleted when the process stops and, after
-- `fleet.forget_after`, by any instance for a process that stopped without saying so.
-- The host creates the table at start-up; run this instead when its account may not create
-- tables (it then needs INSERT, UPDATE, DELETE and SELECT on it).
CREATE SCHEMA IF NOT EXISTS "public";
CREATE TABLE IF NOT EXISTS "public"."throttlehost_instances" (
    process_id uuid PRIMARY KEY,
    host_name text NOT NULL,
    instance_id text NOT NULL,
    version text NOT NULL,
    admin_address text NULL,
    summary text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now()
);
