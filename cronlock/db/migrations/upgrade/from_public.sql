-- Upgrade in place from cronlock 0.1, which kept everything in `public` (its migrations
-- 0001-0005, recorded in public.cronlock_migrations). The tables move with their rows,
-- identity sequences, indexes and constraints, and take the names cronlock's migrations
-- 0001 and 0002 give them; the probe functions go (0003 makes the schema's own).
--
-- public.cronlock_migrations stays behind, on purpose: an instance still running 0.1 reads
-- it, finds its migrations applied and answers errors instead of creating a second, empty
-- ledger in public (which would run every job again). Drop it once no 0.1 instance is left:
--   DROP TABLE public.cronlock_migrations;
ALTER TABLE public.cron_runs SET SCHEMA {schema};
ALTER TABLE {schema}.cron_runs RENAME TO runs;
ALTER TABLE {schema}.runs RENAME CONSTRAINT cron_runs_pkey TO runs_pkey;
ALTER TABLE {schema}.runs RENAME CONSTRAINT cron_runs_status_check TO runs_status_check;
ALTER TABLE {schema}.runs RENAME CONSTRAINT cron_runs_trigger_check TO runs_trigger_check;
ALTER SEQUENCE {schema}.cron_runs_id_seq RENAME TO runs_id_seq;
ALTER INDEX {schema}.cron_runs_one_success_per_slot RENAME TO runs_one_success_per_slot;
ALTER INDEX {schema}.cron_runs_job_newest RENAME TO runs_job_newest;
ALTER INDEX {schema}.cron_runs_running RENAME TO runs_running;

ALTER TABLE public.email_outbox SET SCHEMA {schema};
ALTER TABLE public.email_outbox_rate SET SCHEMA {schema};

-- The demo's users (0.1's migration 0002 made them in public): parked in cronlock's schema
-- until the demo's own migration (cronlock/demo/migrations) claims them as cronlock_demo.users.
ALTER TABLE public.users SET SCHEMA {schema};
ALTER TABLE {schema}.users RENAME TO legacy_demo_users;

DROP FUNCTION IF EXISTS public.cronlock_probe(text, oid, oid, boolean);
DROP FUNCTION IF EXISTS public.cronlock_probe(text, oid, oid, boolean, timestamptz);
