-- Attempts: one ledger row per attempt at a run. A retry (of a failed, timed-out or abandoned
-- attempt) or a lease takeover is a new row with the next attempt number and the row it
-- retries; the unique index on succeeded rows (0005) still allows one success per slot.
-- ON DELETE SET NULL: pruning an old attempt leaves its successor's history intact.
ALTER TABLE {schema}.runs
    ADD COLUMN attempt integer NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    ADD COLUMN retry_of bigint REFERENCES {schema}.runs (id) ON DELETE SET NULL;
CREATE INDEX runs_retry_of ON {schema}.runs (retry_of) WHERE retry_of IS NOT NULL;

-- A cancel request any instance can see: the run's holder polls for it and stops its job
-- (rather than an operator's pg_cancel_backend, which reaches only a running statement).
ALTER TABLE {schema}.runs
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN cancel_requested_by text;

-- Lease mode (jobs declared with `lease=`): a run outside one transaction. While its row says
-- `running` and `lease_expires_at` is ahead of the database clock, the run is live and holds
-- its (job, key); every write of the job happens in a step that locks this row, checks
-- `lease_token` and extends the lease. Tokens come from one sequence, so a newer holder's
-- token is always greater than any older one's.
CREATE SEQUENCE {schema}.lease_tokens AS bigint;
ALTER TABLE {schema}.runs
    ADD COLUMN lease_token bigint,
    ADD COLUMN lease_seconds double precision,
    ADD COLUMN lease_expires_at timestamptz,
    ADD COLUMN deadline_at timestamptz,         -- started_at of attempt 1 + the job's timeout
    ADD COLUMN checkpoint jsonb,                -- the job's resume point, committed by a step
    ADD COLUMN progress jsonb,                  -- what the job says of its progress
    ADD COLUMN steps integer NOT NULL DEFAULT 0;  -- steps committed by this attempt

-- The live or expired lease run of a (job, key), found by trigger, watcher and probe.
CREATE INDEX runs_lease_running ON {schema}.runs (job, (coalesce(key, '')))
    WHERE status = 'running' AND lease_token IS NOT NULL;
