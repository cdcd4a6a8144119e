-- Insert notifications for the PostgreSQL transport, as the host adds them to each queue
-- table it creates or starts on (tables of NServiceBus or of an older host included): every
-- INSERT statement into the table notifies the channel throttlehost_<tag> once, delivered when
-- its transaction commits, and each host's listening connection wakes the queue's idle
-- receivers. <tag> is a 64-bit FNV-1a of the quoted table name in hex (computed by the host).
-- Without the trigger receivers still find messages, at their next peek.
-- Replace "public" and "Sales" with your schema and queue name.
-- Regenerate: cargo run --example print_ddl -- postgres-notify public Sales
CREATE OR REPLACE FUNCTION "public".throttlehost_notify() RETURNS trigger LANGUAGE plpgsql AS $body$
BEGIN
  PERFORM pg_notify(TG_ARGV[0], '');
  RETURN NULL;
END
$body$;
DO $do$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = '"public"."Sales"'::regclass AND tgname = 'throttlehost_notify') THEN
    CREATE TRIGGER throttlehost_notify AFTER INSERT ON "public"."Sales" FOR EACH STATEMENT EXECUTE FUNCTION "public".throttlehost_notify('throttlehost_ecc200cec12a4be8');
  END IF;
END
$do$;
