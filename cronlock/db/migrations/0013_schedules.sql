-- Dynamic schedules (cronlock/core/schedules.py): a job declared `schedule="dynamic"` is a keyed
-- job whose schedules are rows, one per key, set at runtime (`cron.schedules.set`, the HTTP
-- routes, the CLI) and dispatched by the built-in scheduler (SCHEDULER_ENABLED=true).
--
-- `schedule` is a five-field cron expression in the zone `tz`, or NULL with `every` seconds
-- (counted in UTC). `params` are the job's params as its model validated them when the row was
-- set (the key's field included). `next_at` is the schedule's next tick, the slot its next run
-- is for; `due_at` is when that run starts: next_at plus the job's `spread` offset for this key
-- (equal to next_at without spread). `version` grows at every set, so a dispatcher that claimed
-- a row can tell, under the run's lock and at its end, whether the row still says what it read.
-- `claimed_until`: a dispatcher took the row for its due run; others leave it alone until then
-- (a dispatcher killed after its claim only delays the run by that long).
CREATE TABLE {schema}.schedules (
    job           text             NOT NULL,
    key           text             NOT NULL CHECK (key <> ''),
    schedule      text,
    every         integer          CHECK (every > 0),
    tz            text             NOT NULL DEFAULT 'UTC',
    params        jsonb            NOT NULL DEFAULT '{}',
    paused        boolean          NOT NULL DEFAULT false,
    next_at       timestamptz      NOT NULL,
    due_at        timestamptz      NOT NULL,
    version       bigint           NOT NULL DEFAULT 1,
    claimed_until timestamptz,
    claimed_by    text,
    created_at    timestamptz      NOT NULL DEFAULT now(),
    updated_at    timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (job, key),
    CHECK ((schedule IS NULL) <> (every IS NULL))
);

-- What the dispatchers poll: the due rows, in start order. Partial, so paused rows cost the
-- poll nothing, and the poll reads only the due end of the index however many rows there are.
CREATE INDEX schedules_due ON {schema}.schedules (due_at) WHERE NOT paused;

-- "Was this key's slot attempted?" under the run's lock (a dynamic run's first attempt), and
-- the last run of each key (the schedules' listing), without reading the key's whole history.
CREATE INDEX runs_key_slot ON {schema}.runs (job, key, slot)
    WHERE key IS NOT NULL AND trigger IN ('scheduled', 'backfill');
