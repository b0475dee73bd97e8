-- The transactional outbox: rows are written in the job's transaction and delivered later.
-- Everything a provider receives is frozen here at enqueue, so every attempt sends the
-- same idempotency key and the same bytes. Set-based enqueues (INSERT ... SELECT) may omit
-- the key: the database mints one, frozen with the row like the payload.
CREATE TABLE {schema}.email_outbox (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key     text        NOT NULL UNIQUE DEFAULT gen_random_uuid()::text,
    key_created_at      timestamptz NOT NULL DEFAULT now(),
    job                 text        NOT NULL,
    slot                timestamptz,
    user_id             bigint,
    sender              text        NOT NULL,
    recipient           text        NOT NULL,
    subject             text        NOT NULL,
    body                text        NOT NULL,
    status              text        NOT NULL DEFAULT 'pending'
                        CHECK (status IN ('pending', 'sent', 'dead')),
    attempts            integer     NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL DEFAULT now(),
    locked_until        timestamptz,
    claim_token         uuid,
    created_at          timestamptz NOT NULL DEFAULT now(),
    sent_at             timestamptz,
    provider_message_id text,
    last_error          text
);

-- One email per user per job slot: a repeated run cannot enqueue twice.
CREATE UNIQUE INDEX email_outbox_once_per_slot ON {schema}.email_outbox (job, slot, user_id);
-- The senders' claim scan.
CREATE INDEX email_outbox_due ON {schema}.email_outbox (next_attempt_at) WHERE status = 'pending';
CREATE INDEX email_outbox_dead ON {schema}.email_outbox (id) WHERE status = 'dead';
CREATE INDEX email_outbox_sent ON {schema}.email_outbox (sent_at) WHERE status = 'sent';

-- The global send-rate limit: one token bucket shared by every sender of every instance.
-- A sender takes tokens with one UPDATE of this single row (the row lock serialises senders
-- for microseconds); the rate and burst travel with each call, so the row holds only state.
-- `granted` is what the last UPDATE handed out: RETURNING sees only new values.
CREATE TABLE {schema}.email_outbox_rate (
    id         boolean          PRIMARY KEY DEFAULT true CHECK (id),
    tokens     double precision NOT NULL DEFAULT 0,
    updated_at timestamptz      NOT NULL DEFAULT now(),
    granted    integer          NOT NULL DEFAULT 0
);
INSERT INTO {schema}.email_outbox_rate DEFAULT VALUES;
