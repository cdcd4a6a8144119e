-- The held-keys table of a schema (here "public"), for ordered queues with
-- `[queues.ordering] failed_key = "hold"`. A keyed message that failed after its retries
-- stays in its queue; a row here, by queue table and message id, makes every receive pass
-- it over, and since it is its key's oldest message, the key's later messages wait behind
-- it. `throttlehost queues held` lists the rows, `throttlehost queues release` deletes them.
-- The host creates the table at start-up when a queue holds keys; run this instead when its
-- account may not create tables.
CREATE TABLE IF NOT EXISTS "public".throttlehost_held (
    queue_table text NOT NULL,
    message_id uuid NOT NULL,
    key text NOT NULL,
    reason text NOT NULL,
    held_at timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'UTC'),
    PRIMARY KEY (queue_table, message_id)
);
