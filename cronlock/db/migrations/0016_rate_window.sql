-- The outbox's send rate as a window the database keeps (cronlock/delivery/pace.py), in the
-- same single row as 0002's token bucket, so every sender still serialises on one row lock.
-- `starts`: the start times handed to the latest requests (at most OUTBOX_RATE_LIMIT of them,
-- oldest first; some may lie a little in the future: a sender waits for its time, then sends).
-- A new request's time is the n-th latest start plus the window, so no window ever holds more
-- than n starts. `paused_until`: no request starts before it (the provider's Retry-After, or
-- its ratelimit-reset once it says nothing is left). `provider_limit`: its ratelimit-limit, as
-- last answered. The bucket's columns (tokens, updated_at, granted) are left to senders of
-- older releases during a rolling deploy; this release neither reads nor writes them.
ALTER TABLE {schema}.email_outbox_rate
    ADD COLUMN starts         timestamptz[] NOT NULL DEFAULT '{}',
    ADD COLUMN paused_until   timestamptz   NOT NULL DEFAULT '-infinity',
    ADD COLUMN provider_limit integer       CHECK (provider_limit >= 0);
