-- The trigger path's read-only probe (cronlock/db/lock.py) as a function: PL/pgSQL keeps the plans of
-- its statements for the life of the server connection, so a probe is not planned again at
-- every trigger. The client cannot keep prepared statements (statement_cache_size=0 for
-- PgBouncer); the server-side plan cache is invisible to the pooler and safe behind it.
-- Read-only: it never takes the job's lock (see PROBE_SQL in cronlock/db/lock.py for why).
CREATE FUNCTION cronlock_probe(job_name text, lock_classid oid, lock_objid oid,
                               with_ledger boolean)
RETURNS TABLE (db_now timestamptz, standby boolean, done_slot timestamptz, running boolean)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    db_now := now();
    standby := pg_is_in_recovery();
    -- The newest slot that already succeeded; a job without a schedule has none.
    IF with_ledger THEN
        SELECT max(r.slot) INTO done_slot FROM cron_runs AS r
        WHERE r.job = job_name AND r.status = 'succeeded'
          AND r.trigger IN ('scheduled', 'backfill');
    END IF;
    -- Is the job's lock held right now, by anyone, in this database?
    running := EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.classid = lock_classid AND l.objid = lock_objid
          AND l.database = (SELECT d.oid FROM pg_database AS d
                            WHERE d.datname = current_database()));
    RETURN NEXT;
END
$$;
