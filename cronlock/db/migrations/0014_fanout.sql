-- Fan-out runs (`@job(..., fanout=True)`, cronlock/core/fanout.py): a run's planner writes
-- its items here in the run's planning transaction; every instance serving the job works
-- them, each item in one transaction that commits its effects with its `succeeded` mark.
--
-- One row per planned fan-out. `run_id` is the attempt working it now: a retry or a backfill
-- of the slot moves it to the new attempt, which continues the unfinished and failed items
-- (the finished ones stay finished). The ledger's retention deletes the fan-out (and its
-- items) with that run (cronlock/core/ledger.py `prune`); no foreign key to the runs, so
-- that emptying the ledger by hand (TRUNCATE) still works as before.
CREATE TABLE {schema}.fanouts (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id      bigint      NOT NULL,
    job         text        NOT NULL,
    key         text,
    slot        timestamptz,
    state       text        NOT NULL DEFAULT 'running'
                CHECK (state IN ('running', 'succeeded', 'failed', 'cancelled')),
    total       integer     NOT NULL CHECK (total >= 0),
    -- Items settle into counters split in `shards` rows (item n counts in shard n % shards),
    -- so that concurrent item commits do not all queue on one row; `shards_left` counts the
    -- shards with items still unsettled. The transaction that takes it to 0 settled the last
    -- item: it runs `done` and ends the run, under this row's lock.
    shards      integer     NOT NULL CHECK (shards >= 0),
    shards_left integer     NOT NULL CHECK (shards_left >= 0),
    planned_at  timestamptz NOT NULL DEFAULT now(),
    settled_at  timestamptz
);
CREATE UNIQUE INDEX fanouts_run ON {schema}.fanouts (run_id);
-- The running fan-outs, which every instance's workers look for.
CREATE INDEX fanouts_running ON {schema}.fanouts (job) WHERE state = 'running';
CREATE INDEX fanouts_slot ON {schema}.fanouts (job, (coalesce(key, '')), slot);

CREATE TABLE {schema}.fanout_shards (
    fanout_id bigint  NOT NULL REFERENCES {schema}.fanouts (id) ON DELETE CASCADE,
    shard     integer NOT NULL,
    remaining integer NOT NULL CHECK (remaining >= 0),
    done      integer NOT NULL DEFAULT 0,
    failed    integer NOT NULL DEFAULT 0,
    PRIMARY KEY (fanout_id, shard)
);

-- The items: written by COPY in the planning transaction. `attempts` counts the attempts
-- that ended (a worker that died mid-item rolled its attempt back with its effects);
-- `not_before` is a failed attempt's backoff. No foreign key to the fan-out: its check, one
-- per row, made COPYing a million items three times slower; the ledger's retention deletes
-- a fan-out's items with it (cronlock/core/ledger.py `prune`).
CREATE TABLE {schema}.fanout_items (
    fanout_id   bigint      NOT NULL,
    n           integer     NOT NULL,
    item        jsonb       NOT NULL,
    status      text        NOT NULL DEFAULT 'pending'
                CHECK (status IN ('pending', 'succeeded', 'failed')),
    attempts    integer     NOT NULL DEFAULT 0,
    not_before  timestamptz,
    error       text,
    result      jsonb,
    instance    text,
    finished_at timestamptz,
    PRIMARY KEY (fanout_id, n)
);
-- What the workers claim (FOR UPDATE SKIP LOCKED), in plan order.
CREATE INDEX fanout_items_pending ON {schema}.fanout_items (fanout_id, n) WHERE status = 'pending';
CREATE INDEX fanout_items_failed ON {schema}.fanout_items (fanout_id, n) WHERE status = 'failed';

-- Items in flight, as each instance's workers last published them (a dead instance's rows
-- go stale and stop counting): the `running` of /cron/runs/{id}.
CREATE TABLE {schema}.fanout_workers (
    fanout_id bigint      NOT NULL REFERENCES {schema}.fanouts (id) ON DELETE CASCADE,
    instance  text        NOT NULL,
    running   integer     NOT NULL,
    seen_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (fanout_id, instance)
);
