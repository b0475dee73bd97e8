-- Signed deliveries (TRIGGER_AUTH=qstash): QStash sends a message again when it did not get
-- the answer, under the same `Upstash-Message-Id`. The id is recorded with the run it started,
-- so a redelivery of a message whose run succeeded is answered "already done" (that run's id)
-- and never runs again, for any job, scheduled or not; after a failed run it runs again.
ALTER TABLE {schema}.runs ADD COLUMN message_id text;
CREATE INDEX runs_message ON {schema}.runs (message_id) WHERE message_id IS NOT NULL;
