-- The probe (0003, 0005) for lease jobs too: a lease run is running while its lease is live
-- on the database's clock, with no advisory lock held (that is only taken for the moment a
-- trigger decides). A new signature, as in 0005: instances of the previous release keep
-- calling the six-argument form during a rolling deploy.
CREATE FUNCTION {schema}.probe(job_name text, run_key text, lock_classid oid, lock_objid oid,
                               with_ledger boolean, done_hint timestamptz, with_lease boolean)
RETURNS TABLE (db_now timestamptz, standby boolean, done_slot timestamptz, running boolean)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    db_now := now();
    standby := pg_is_in_recovery();
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
