-- Outbox delivery (cronlock/delivery/outbox.py).

-- Set-based enqueues (INSERT ... SELECT) may omit the key: the database mints a stable one,
-- frozen with the row like the payload.
ALTER TABLE email_outbox ALTER COLUMN idempotency_key SET DEFAULT gen_random_uuid()::text;

-- The global send-rate limit: one token bucket shared by every sender of every instance.
-- A sender takes tokens with one UPDATE of this single row (the row lock serialises senders
-- for microseconds); the rate and burst travel with each call, so the row holds only state.
-- `granted` is what the last UPDATE handed out: RETURNING sees only new values.
CREATE TABLE email_outbox_rate (
    id         boolean          PRIMARY KEY DEFAULT true CHECK (id),
    tokens     double precision NOT NULL DEFAULT 0,
    updated_at timestamptz      NOT NULL DEFAULT now(),
    granted    integer          NOT NULL DEFAULT 0
);
INSERT INTO email_outbox_rate DEFAULT VALUES;
