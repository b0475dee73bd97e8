-- What a failed run raised (cronlock/core/failure.py): {"type", "message", "traceback"}, the
-- message and traceback bounded in size and with the settings' secrets replaced by `***`.
-- `error` keeps its one line ("Type: message"); this is the detail behind it.
ALTER TABLE {schema}.runs ADD COLUMN failure jsonb;

-- When this database first saw each job: a job's history starts there, so slots before it
-- are neither missed nor overdue (issue 30, "Honest history"; the code that registers jobs
-- here and reads it comes next). Jobs already in the ledger count from their first run, the
-- best this database knows.
CREATE TABLE {schema}.jobs_seen (
    job           text        PRIMARY KEY,
    first_seen_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {schema}.jobs_seen (job, first_seen_at)
SELECT job, min(started_at) FROM {schema}.runs GROUP BY job;
