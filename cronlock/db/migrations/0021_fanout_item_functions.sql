-- The statements of cronlock's own that every fan-out item runs (cronlock/core/fanout.py), as
-- functions: PL/pgSQL keeps their plans for the life of the server connection, where a
-- parameterised statement is parsed and planned again at every item (the client keeps no
-- prepared statements behind PgBouncer; 0003_probe.sql does the same for the trigger's
-- probe). Together with the session reset folded into the mark, this took the database's
-- time per item from about twice the bare claim + write + mark loop's to 1.3 x
-- (bench/fanout.py, BENCHMARKS.md). The session reset is the one a job's run gets too
-- (cronlock/db/lock.py `reset_session`): one list of what is cleared, for both.

-- A run's or an item's transaction timeouts: statement and idle-in-transaction `p_timeout`,
-- the client check `p_check`, and on PostgreSQL 17+ (else NULL) `transaction_timeout` with
-- what is left of `p_transaction_timeout_ms` since the transaction began (now()).
-- `transaction_timeout` is turned off first: set while its timer runs (a role's or database's
-- own default, started at BEGIN) it would keep that timer; off stops it, and the new value
-- starts afresh. The pinned search_path is all the SET clause restores at exit: the timeouts
-- stay for the rest of the caller's transaction.
CREATE FUNCTION {schema}.set_timeouts(p_timeout text, p_check text,
                                      p_transaction_timeout_ms bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM set_config('statement_timeout', p_timeout, true),
            set_config('idle_in_transaction_session_timeout', p_timeout, true),
            set_config('client_connection_check_interval', p_check, true);
    IF p_transaction_timeout_ms IS NOT NULL THEN
        PERFORM set_config('transaction_timeout', '0', true);
        PERFORM set_config(
            'transaction_timeout',
            greatest(1, p_transaction_timeout_ms
                        - (extract(epoch FROM clock_timestamp() - now()) * 1000)::bigint)
                || 'ms',
            true);
    END IF;
END
$$;

-- Clear what a job or an item left on the session, its transaction still open (the
-- connection returns to the pool after it, and through PgBouncer to other clients): its
-- settings, session advisory locks, LISTENs and open cursors; then the timeouts again (RESET
-- ALL dropped them). The caller resets the role first (RESET SESSION AUTHORIZATION, RESET
-- ROLE, which RESET ALL leaves be): a role the job switched to may not use this schema. No
-- SET clause: a function's SET clause restores its variables at exit, which would undo this
-- RESET ALL for them. The portal running it is active, and CLOSE ALL leaves active portals be.
CREATE FUNCTION {schema}.session_reset(p_timeout text, p_check text,
                                       p_transaction_timeout_ms bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    RESET ALL;
    PERFORM pg_catalog.pg_advisory_unlock_all();
    UNLISTEN *;
    EXECUTE 'CLOSE ALL';
    PERFORM {schema}.set_timeouts(p_timeout, p_check, p_transaction_timeout_ms);
END
$$;

-- One pending item of a running, uncancelled fan-out, locked (SKIP LOCKED, in plan order),
-- after the transaction's timeouts are set. `run_id` is the attempt working the fan-out now (a
-- retry may have taken it over since the worker last looked), `traceparent` its span's. No
-- row when there is none to give.
CREATE FUNCTION {schema}.fanout_claim(p_fanout bigint, p_timeout text, p_check text,
                                      p_transaction_timeout_ms bigint)
RETURNS TABLE (n integer, item jsonb, attempts integer, run_id bigint, traceparent text)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    PERFORM {schema}.set_timeouts(p_timeout, p_check, p_transaction_timeout_ms);
    RETURN QUERY
    SELECT i.n, i.item, i.attempts, f.run_id, f.traceparent
    FROM {schema}.fanout_items AS i
    JOIN {schema}.fanouts AS f ON f.id = i.fanout_id
    JOIN {schema}.runs AS r ON r.id = f.run_id
    WHERE i.fanout_id = p_fanout AND i.status = 'pending'
      AND (i.not_before IS NULL OR i.not_before <= now())
      AND f.state = 'running' AND r.cancel_requested_at IS NULL
    ORDER BY i.n
    LIMIT 1
    FOR UPDATE OF i SKIP LOCKED;
END
$$;

-- Item `p_n` succeeded: the session reset a job gets (its role first, see session_reset),
-- then the item marked and taken off its shard's counter. Returns the counter's new value,
-- or NULL when the item was settled already. No SET clause, for the reset's sake; the marking
-- is in fanout_item_settle, whose search_path is pinned.
CREATE FUNCTION {schema}.fanout_item_succeeded(p_fanout bigint, p_n integer, p_result jsonb,
                                               p_instance text, p_shards integer,
                                               p_timeout text, p_check text,
                                               p_transaction_timeout_ms bigint)
RETURNS integer
LANGUAGE plpgsql
AS $$
BEGIN
    RESET SESSION AUTHORIZATION;
    RESET ROLE;
    PERFORM {schema}.session_reset(p_timeout, p_check, p_transaction_timeout_ms);
    RETURN {schema}.fanout_item_settle(p_fanout, p_n, p_result, p_instance, p_shards);
END
$$;

CREATE FUNCTION {schema}.fanout_item_settle(p_fanout bigint, p_n integer, p_result jsonb,
                                            p_instance text, p_shards integer)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    left_ integer;
BEGIN
    UPDATE {schema}.fanout_items AS i
    SET status = 'succeeded', attempts = i.attempts + 1, result = p_result, error = NULL,
        instance = p_instance, finished_at = clock_timestamp(), not_before = NULL
    WHERE i.fanout_id = p_fanout AND i.n = p_n AND i.status = 'pending';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    UPDATE {schema}.fanout_shards AS s
    SET remaining = s.remaining - 1, done = s.done + 1
    WHERE s.fanout_id = p_fanout AND s.shard = p_n % p_shards
    RETURNING s.remaining INTO left_;
    RETURN left_;
END
$$;
