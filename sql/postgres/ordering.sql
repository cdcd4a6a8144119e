-- The expression indexes a PostgreSQL queue with ordered execution gets at host start-up
-- (`[queues.ordering]`), here for queue public."Sales" ordered by the
-- NServiceBus.ConversationId header and by stages. The host builds the missing ones itself,
-- CONCURRENTLY (sends and receives go on), one host at a time under the table's advisory
-- lock. Run this instead, one statement at a time and outside a transaction, when the
-- host's account may not create objects (host.create_queues = false), with your table and key
-- header. Each index keeps a header's value as read from the Headers JSON text, so an ordered
-- receive checks "is an older message of this key stored?" and "is a message of the previous
-- stage stored?" with one index probe each. The index names are the host's: a hash of the
-- table and the header.
CREATE INDEX CONCURRENTLY IF NOT EXISTS throttlehost_order_aae43fd96b145644 ON "public"."Sales" (((CASE WHEN strpos(Headers, '"NServiceBus.ConversationId":"') > 0 THEN split_part(split_part(Headers, '"NServiceBus.ConversationId":"', 2), '"', 1) WHEN strpos(Headers, '"NServiceBus.ConversationId"') = 0 THEN NULL ELSE substring(Headers from '[{,]\s*"NServiceBus\.ConversationId"\s*:\s*"((?:[^"\\]|\\.)*)"') END)), Seq);

CREATE INDEX CONCURRENTLY IF NOT EXISTS throttlehost_order_a141e1d5fdab535f ON "public"."Sales" (((CASE WHEN strpos(Headers, '"throttlehost.ExecutionStage":"') > 0 THEN split_part(split_part(Headers, '"throttlehost.ExecutionStage":"', 2), '"', 1) WHEN strpos(Headers, '"throttlehost.ExecutionStage"') = 0 THEN NULL ELSE substring(Headers from '[{,]\s*"throttlehost\.ExecutionStage"\s*:\s*"((?:[^"\\]|\\.)*)"') END)));
