-- The trigger path's read-only probe (cronlock/db/lock.py) as a function: PL/pgSQL keeps the plans of
-- its statements for the life of the server connection, so a probe is not planned again at
-- every trigger. The client cannot keep prepared statements (statement_cache_size=0 for
-- PgBouncer); the server-side plan cache is invisible to the pooler and safe behind it.
-- Read-only: it never takes the job's lock (see PROBE_SQL in cronlock/db/lock.py for why).
--
-- When the ledger already shows the slot the caller expects (`done_hint`) as succeeded, the
-- pg_locks scan, the probe's dearest part (it reads every lock partition and every backend's
-- fast-path slots), is skipped and `running` is NULL. The hint only decides whether to look:
-- the caller still decides "already done" against the database's clock (`db_now`).
--
-- Its body names the ledger with the schema, and its search_path is pinned to pg_catalog, so
-- a caller's search_path (a job may change it; PgBouncer shares sessions) never changes
-- which table it reads.
CREATE FUNCTION {schema}.probe(job_name text, lock_classid oid, lock_objid oid,
                               with_ledger boolean, done_hint timestamptz)
RETURNS TABLE (db_now timestamptz, standby boolean, done_slot timestamptz, running boolean)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    db_now := now();
    standby := pg_is_in_recovery();
    -- The newest slot that already succeeded; a job without a schedule has none.
    IF with_ledger THEN
        SELECT max(r.slot) INTO done_slot FROM {schema}.runs AS r
        WHERE r.job = job_name AND r.status = 'succeeded'
          AND r.trigger IN ('scheduled', 'backfill');
    END IF;
    -- Is the job's lock held right now, by anyone, in this database?
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
