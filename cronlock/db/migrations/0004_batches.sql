-- Batched delivery (EMAIL_BATCH_SIZE > 1): a batch is one provider request carrying many
-- outbox rows. Its membership and its exact request bytes are frozen here, with its
-- idempotency key, before the first attempt, so every attempt (after a timeout, a 5xx, a
-- 429, a sender killed mid-request, a lease taken over) sends the same members, the same
-- bytes and the same key. The batch has its own lease and claim token, like a row.
--
-- The key is derived from the members' own keys, so the same members always make the same
-- key and the same bytes; it is not unique here: rows re-queued together after their batch
-- died form the same batch again, on purpose (the provider answers it as the same request).
CREATE TABLE {schema}.email_batch (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key text        NOT NULL,
    key_created_at  timestamptz NOT NULL DEFAULT now(),
    body            bytea       NOT NULL,
    size            integer     NOT NULL CHECK (size > 0),
    status          text        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'done', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    locked_until    timestamptz,
    claim_token     uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    last_error      text
);

-- The senders' scan for batches due again (retries, leases that ended).
CREATE INDEX email_batch_due ON {schema}.email_batch (next_attempt_at) WHERE status = 'pending';
CREATE INDEX email_batch_finished ON {schema}.email_batch (finished_at) WHERE status <> 'pending';

-- A row in a batch is delivered by its batch only; `batch_index` is its place in the body.
-- The batch stays as long as one of its rows does (dead letters show which batch they were in).
ALTER TABLE {schema}.email_outbox
    ADD COLUMN batch_id    bigint REFERENCES {schema}.email_batch (id),
    ADD COLUMN batch_index integer;
CREATE INDEX email_outbox_batch ON {schema}.email_outbox (batch_id) WHERE batch_id IS NOT NULL;
-- The scan that forms new batches skips rows already in one.
CREATE INDEX email_outbox_due_unbatched ON {schema}.email_outbox (next_attempt_at, id)
    WHERE status = 'pending' AND batch_id IS NULL;
