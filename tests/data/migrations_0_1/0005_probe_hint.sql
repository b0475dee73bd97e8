-- The probe with a hint (cronlock/db/lock.py): when the ledger already shows the slot the caller
-- expects as succeeded, the pg_locks scan, the probe's dearest part (it reads every lock
-- partition and every backend's fast-path slots), is skipped and `running` is NULL. The
-- hint only decides whether to look: the caller still decides "already done" against the
-- database's clock (`db_now`), and a wrong hint (an instance whose clock is off at a tick)
-- costs no more than the real attempt that follows a NULL. The four-argument form of
-- migration 0004 stays for instances not yet upgraded during a rolling deploy.
CREATE FUNCTION cronlock_probe(job_name text, lock_classid oid, lock_objid oid,
                               with_ledger boolean, done_hint timestamptz)
RETURNS TABLE (db_now timestamptz, standby boolean, done_slot timestamptz, running boolean)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    db_now := now();
    standby := pg_is_in_recovery();
    IF with_ledger THEN
        SELECT max(r.slot) INTO done_slot FROM cron_runs AS r
        WHERE r.job = job_name AND r.status = 'succeeded'
          AND r.trigger IN ('scheduled', 'backfill');
    END IF;
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
