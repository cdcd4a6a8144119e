-- The instance registry of a schema (here "public"): one row per running host process,
-- written by its heartbeat (`[fleet]` in the host's configuration), read by `/fleet` and
-- `throttlehost status --fleet`, deleted when the process stops and, after
-- `fleet.forget_after`, by any instance for a process that stopped without saying so.
-- The host creates the table at start-up; run this instead when its account may not create
-- tables (it then needs INSERT, UPDATE, DELETE and SELECT on it, and to read
-- pg_stat_activity, which every role may). `backend` is the server process of the session
-- that wrote the last heartbeat: the others see a killed host's sessions close and take its
-- leads at once. The DO block adds it to a table an earlier version made.
CREATE SCHEMA IF NOT EXISTS "public";
CREATE TABLE IF NOT EXISTS "public"."throttlehost_instances" (
    process_id uuid PRIMARY KEY,
    host_name text NOT NULL,
    instance_id text NOT NULL,
    version text NOT NULL,
    admin_address text NULL,
    summary text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now(),
    backend integer NULL
);
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
        WHERE attrelid = to_regclass('"public"."throttlehost_instances"') AND attname = 'backend'
            AND NOT attisdropped) THEN
        ALTER TABLE "public"."throttlehost_instances" ADD COLUMN backend integer NULL;
    END IF;
END $$;
