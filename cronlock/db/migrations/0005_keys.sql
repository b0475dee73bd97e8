-- Keyed jobs: a run of a keyed job carries its key's canonical text (cronlock/core/jobs.py `key_text`);
-- NULL for a job without a key, so every existing row and every key-less job stays as it was.
ALTER TABLE {schema}.runs ADD COLUMN key text;

-- "Once per slot" becomes once per (job, key, slot). The key is coalesced to '' rather than
-- the index declared NULLS NOT DISTINCT, which PostgreSQL 14 does not have: two NULL keys
-- then count as equal, as the old (job, slot) index made them. A keyed job's key is never ''
-- (refused at its trigger), so '' cannot stand for two things within one job. The new index
-- is built before the old one goes, so the guarantee holds throughout this transaction.
CREATE UNIQUE INDEX runs_one_success_per_key_slot
    ON {schema}.runs (job, (coalesce(key, '')), slot)
    WHERE status = 'succeeded' AND trigger IN ('scheduled', 'backfill');
DROP INDEX {schema}.runs_one_success_per_slot;

-- GET /cron/runs?job=&key=: one key's history, newest first.
CREATE INDEX runs_job_key_newest ON {schema}.runs (job, key, id DESC) WHERE key IS NOT NULL;

-- The probe (0003) with the run's key: the ledger's done slot is per key. A new signature
-- rather than a replacement: instances of the previous release keep calling the five-argument
-- form until they are replaced (a rolling deploy), and it keeps answering for key-less jobs,
-- the only ones they know. Same body otherwise (see 0003 for why it is a function).
CREATE FUNCTION {schema}.probe(job_name text, run_key text, lock_classid oid, lock_objid oid,
                               with_ledger boolean, done_hint timestamptz)
RETURNS TABLE (db_now timestamptz, standby boolean, done_slot timestamptz, running boolean)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    db_now := now();
    standby := pg_is_in_recovery();
    -- The newest slot that already succeeded for this key; coalesce as in the unique index,
    -- so that the index answers.
    IF with_ledger THEN
        SELECT max(r.slot) INTO done_slot FROM {schema}.runs AS r
        WHERE r.job = job_name AND coalesce(r.key, '') = coalesce(run_key, '')
          AND r.status = 'succeeded' AND r.trigger IN ('scheduled', 'backfill');
    END IF;
    -- Is the run's lock held right now, by anyone, in this database?
    IF done_hint IS NULL OR done_slot IS DISTINCT FROM done_hint THEN
        running := EXISTS (
            SELECT 1 FROM pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.classid = lock_classid AND l.objid = lock_objid
              AND l.database = (SELECT d.oid FROM pg_database AS d
                                WHERE d.datname = current_database()));
    END IF;
    RETURN NEXT;
END
$$;
