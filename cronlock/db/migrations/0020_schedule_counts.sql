-- How many schedules each dynamic job has, and how many are paused (`/cron/jobs`, `/metrics`:
-- cronlock/core/schedules.py `stats`), kept rather than counted: counting a million rows at each
-- look read them all (seconds). Triggers on `schedules` append deltas, one row per statement
-- and job for inserts and deletes, one per row whose `paused` or `job` changes; nothing else
-- fires them (a dispatcher's claim and advance change neither). Appending takes no lock anyone
-- waits for, so concurrent sign-ups never queue on a counter. The reader sums a job's rows; the
-- dispatchers fold them into one per job now and then (`compact_counts`). Due and late are
-- counted from `schedules_due`, whose due end is small.
CREATE TABLE {schema}.schedule_counts (
    job       text   NOT NULL,
    schedules bigint NOT NULL,
    paused    bigint NOT NULL
);
CREATE INDEX schedule_counts_job ON {schema}.schedule_counts (job);

INSERT INTO {schema}.schedule_counts (job, schedules, paused)
SELECT job, count(*), count(*) FILTER (WHERE paused) FROM {schema}.schedules GROUP BY job;

-- Bodies name the tables with the schema, and their search_path is pinned, so a caller's
-- search_path never changes what they write.
CREATE FUNCTION {schema}.schedule_counts_added() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO {schema}.schedule_counts (job, schedules, paused)
    SELECT a.job, count(*), count(*) FILTER (WHERE a.paused) FROM added AS a GROUP BY a.job;
    RETURN NULL;
END
$$;

CREATE FUNCTION {schema}.schedule_counts_removed() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO {schema}.schedule_counts (job, schedules, paused)
    SELECT r.job, -count(*), -count(*) FILTER (WHERE r.paused) FROM removed AS r GROUP BY r.job;
    RETURN NULL;
END
$$;

CREATE FUNCTION {schema}.schedule_counts_changed() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO {schema}.schedule_counts (job, schedules, paused)
    VALUES (OLD.job, -1, -OLD.paused::int), (NEW.job, 1, NEW.paused::int);
    RETURN NULL;
END
$$;

CREATE FUNCTION {schema}.schedule_counts_truncated() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM {schema}.schedule_counts;
    RETURN NULL;
END
$$;

CREATE TRIGGER schedule_counts_added AFTER INSERT ON {schema}.schedules
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT
    EXECUTE FUNCTION {schema}.schedule_counts_added();
CREATE TRIGGER schedule_counts_removed AFTER DELETE ON {schema}.schedules
    REFERENCING OLD TABLE AS removed FOR EACH STATEMENT
    EXECUTE FUNCTION {schema}.schedule_counts_removed();
-- Per row, and only where a count moves: the WHEN is checked without calling the function.
CREATE TRIGGER schedule_counts_changed AFTER UPDATE ON {schema}.schedules
    FOR EACH ROW WHEN (OLD.paused IS DISTINCT FROM NEW.paused OR OLD.job IS DISTINCT FROM NEW.job)
    EXECUTE FUNCTION {schema}.schedule_counts_changed();
CREATE TRIGGER schedule_counts_truncated AFTER TRUNCATE ON {schema}.schedules
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.schedule_counts_truncated();
