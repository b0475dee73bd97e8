-- Emails of keyed jobs: an outbox row carries its run's key (NULL for a job without one), and
-- "one email per user per slot" becomes one per (job, key, slot, user). Under the old index
-- a keyed job's runs for two keys in one slot could queue one email per user between them:
-- the second run's was dropped silently (ENQUEUE's ON CONFLICT DO NOTHING). The key is
-- coalesced to '' as runs' is (0005). The new index is built before the old one goes.
ALTER TABLE {schema}.email_outbox ADD COLUMN key text;
CREATE UNIQUE INDEX email_outbox_once_per_key_slot
    ON {schema}.email_outbox (job, (coalesce(key, '')), slot, user_id);
DROP INDEX {schema}.email_outbox_once_per_slot;
