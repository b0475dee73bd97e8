-- A leaner outbox (issue 28): the same rows, keys and guarantees, with two fewer index
-- entries per email. Nothing is copied or rewritten: every pending, sent and dead row keeps
-- its columns and its idempotency key. What an email costs, and why each remaining index
-- exists: docs/outbox.md ("What one email costs").
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
