-- A leaner outbox (issue 28): the same rows, keys and guarantees, with two fewer index
-- entries per email and no foreign-key trigger. Nothing is copied or rewritten (one index
-- build reads the table, holding off writes to it meanwhile): every pending, sent and dead
-- row keeps its columns and its idempotency key. What an email costs, and why each remaining
-- index exists: docs/outbox.md ("What one email costs").
--
-- 1. One index of due rows, not two. email_outbox_due (next_attempt_at) WHERE pending held
--    every pending row a second time next to email_outbox_due_unbatched (0004), which the
--    claims and the batch former read. Members of a pending batch are due through their batch
--    (their own next_attempt_at is 'infinity'), so no scan needs them in a due index.
DROP INDEX {schema}.email_outbox_due;

-- 2. Key uniqueness only where the once-per index does not already imply it. An email with
--    a user and a slot has a key derived from its (job, key, slot, user) (the digest's
--    `<job>:<epoch>:<user>`, or outbox.enqueue's stable_key, which folds in the user when the
--    caller names the email), and email_outbox_once_per_key_slot (0010) allows one row per
--    (job, key, slot, user): two such rows cannot share a key. The others (no user or no slot:
--    a named email of a run, a manual run's random key) are still checked here, and enqueue's
--    ON CONFLICT DO NOTHING still makes a second enqueue of one of them a no-op. The new index
--    is built before the old constraint goes, so keys stay guarded throughout.
CREATE UNIQUE INDEX email_outbox_key ON {schema}.email_outbox (idempotency_key)
    WHERE user_id IS NULL OR slot IS NULL;
ALTER TABLE {schema}.email_outbox DROP CONSTRAINT email_outbox_idempotency_key_key;

-- 3. No foreign key from a row to its batch (0004's email_outbox_batch_id_fkey). Its trigger
--    ran for every row inserted, batch or not (a digest's 900,000 inserts queued 900,000
--    checks of a NULL), and every member written into a batch looked the batch up again and
--    locked it. What it guarded holds by construction: a row joins a batch only in the
--    transaction that creates the batch (outbox.form_batches), and a batch is deleted only
--    once no row names it (PRUNE_BATCHES_SQL's NOT EXISTS, on email_outbox_batch).
ALTER TABLE {schema}.email_outbox DROP CONSTRAINT email_outbox_batch_id_fkey;
