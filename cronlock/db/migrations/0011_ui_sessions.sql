-- The dashboard's sessions (cronlock/web/ui/session.py). A row per login: logout deletes it, so every
-- instance stops honouring it at once. Only a hash of the cookie's value is stored, so a
-- reader of this table cannot take a session over; `token_fingerprint` is a hash of the token
-- it was made with, so rotating that token ends its sessions. `kind` is what the token may do:
-- 'read' (the read token: see) or 'secret' (the cron secret: also act).
CREATE TABLE {schema}.ui_sessions (
    id_hash           bytea       PRIMARY KEY,
    kind              text        NOT NULL CHECK (kind IN ('read', 'secret')),
    token_fingerprint bytea       NOT NULL,
    csrf_token        text        NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz NOT NULL
);
CREATE INDEX ui_sessions_expiry ON {schema}.ui_sessions (expires_at);

-- What was done through the dashboard, by which kind of token (a manual run is also a runs
-- row with source 'ui'; a requeue changes the outbox rows it names).
CREATE TABLE {schema}.ui_actions (
    id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    kind   text        NOT NULL,
    action text        NOT NULL,
    target text,
    detail jsonb
);
