-- The run ledger: one row per run that took the lock.
CREATE TABLE {schema}.runs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job         text        NOT NULL,
    slot        timestamptz,                       -- NULL for jobs without a schedule
    status      text        NOT NULL DEFAULT 'running'
                CHECK (status IN ('running', 'succeeded', 'failed', 'timed_out',
                                  'cancelled', 'abandoned')),
    trigger     text        NOT NULL
                CHECK (trigger IN ('scheduled', 'manual', 'backfill')),
    source      text        NOT NULL DEFAULT 'http',  -- http, cli
    instance    text        NOT NULL,
    backend_pid integer,                            -- the backend holding the lock while running
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    duration_ms double precision,
    params      jsonb,
    result      jsonb,
    error       text
);

-- "Once per slot" is a database fact: one succeeded scheduled (or backfill) run per (job, slot).
-- Manual runs (?force=true) are recorded but do not count.
CREATE UNIQUE INDEX runs_one_success_per_slot
    ON {schema}.runs (job, slot)
    WHERE status = 'succeeded' AND trigger IN ('scheduled', 'backfill');

CREATE INDEX runs_job_newest ON {schema}.runs (job, id DESC);
CREATE INDEX runs_running ON {schema}.runs (job) WHERE status = 'running';
