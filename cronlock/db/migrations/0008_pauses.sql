-- Pause and resume (cronlock/core/pause.py): a job with a row here is paused until `until` (for ever
-- when NULL). Scheduled, backfill, catch-up, retry and built-in scheduler runs skip it
-- ("paused"); a manual run (force=true) still runs. In the database, so every instance agrees
-- the moment the row commits. Resume deletes the row; an expired `until` is simply ignored.
CREATE TABLE {schema}.pauses (
    job        text PRIMARY KEY,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    paused_by  text NOT NULL,
    note       text,
    until      timestamptz,
    CHECK (until IS NULL OR until > paused_at)
);

-- The probe (0005) for this release's jobs: whether the job is paused, so that a paused job's
-- skip stays one round trip (a paused job answers at once: neither the ledger, pg_locks nor
-- the leases are read), and for lease jobs (`with_lease`) whether a lease is live, since a
-- lease run holds no advisory lock between its steps (cronlock/core/lease.py). A new signature rather
-- than a replacement, as 0005 did: instances of the previous release keep calling the
-- six-argument form during a rolling deploy.
CREATE FUNCTION {schema}.probe(job_name text, run_key text, lock_classid oid, lock_objid oid,
                               with_ledger boolean, done_hint timestamptz, with_lease boolean,
                               with_pause boolean)
RETURNS TABLE (db_now timestamptz, standby boolean, done_slot timestamptz, running boolean,
               paused boolean)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    db_now := now();
    standby := pg_is_in_recovery();
    paused := with_pause AND EXISTS (
        SELECT 1 FROM {schema}.pauses AS p
        WHERE p.job = job_name AND (p.until IS NULL OR p.until > db_now));
    IF paused THEN
        RETURN NEXT;
        RETURN;
    END IF;
    IF with_ledger THEN
        SELECT max(r.slot) INTO done_slot FROM {schema}.runs AS r
        WHERE r.job = job_name AND coalesce(r.key, '') = coalesce(run_key, '')
          AND r.status = 'succeeded' AND r.trigger IN ('scheduled', 'backfill');
    END IF;
    IF done_hint IS NULL OR done_slot IS DISTINCT FROM done_hint THEN
        running := EXISTS (
            SELECT 1 FROM pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.classid = lock_classid AND l.objid = lock_objid
              AND l.database = (SELECT d.oid FROM pg_database AS d
                                WHERE d.datname = current_database()));
        -- A live lease (index runs_lease_running, migration 0007).
        IF with_lease AND NOT running THEN
            running := EXISTS (
                SELECT 1 FROM {schema}.runs AS r
                WHERE r.job = job_name AND coalesce(r.key, '') = coalesce(run_key, '')
                  AND r.status = 'running' AND r.lease_token IS NOT NULL
                  AND r.lease_expires_at > now());
        END IF;
    END IF;
    RETURN NEXT;
END
$$;
