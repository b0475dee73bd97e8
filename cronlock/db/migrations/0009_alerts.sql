-- Alerts (cronlock/delivery/alerts.py): webhooks and pings, through a durable queue. A row per delivery;
-- `msg_id` is the event's identity (the webhook-id a receiver deduplicates by), unique, so an
-- event raised by several instances at once (an overdue slot) is queued once. Claimed with
-- SKIP LOCKED and a lease (`claimed_until`) as the email outbox is: a sender that dies
-- mid-send leaves its claim to expire and another instance sends again, with the same id.
CREATE TABLE {schema}.alerts (
    id              bigserial PRIMARY KEY,
    msg_id          text        NOT NULL UNIQUE,
    kind            text        NOT NULL CHECK (kind IN ('webhook', 'ping')),
    event           text        NOT NULL,
    job             text,
    url             text        NOT NULL,
    body            jsonb       NOT NULL,
    status          text        NOT NULL DEFAULT 'pending'
                                CHECK (status IN ('pending', 'sent', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- Past this the row is given up ("dead"): a ping's retries end with the job's grace,
    -- since a late "start" or "success" ping would lie about when it happened.
    expires_at      timestamptz NOT NULL,
    claimed_until   timestamptz,
    claimed_by      text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz
);
CREATE INDEX alerts_due ON {schema}.alerts (next_attempt_at) WHERE status = 'pending';

-- The alert scanner reads the runs that finished (or started) since its last look.
CREATE INDEX runs_finished_at ON {schema}.runs (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX runs_started_at ON {schema}.runs (started_at);
