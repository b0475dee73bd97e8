-- Tracing (docs/tracing.md): the W3C `traceparent` of the span of the attempt working a
-- fan-out now (its planning, or the retry that continued it), when that attempt was traced.
-- Items run on any instance, long after the span ended: each item's span takes this as its
-- parent, as an email's send links to the `traceparent` stored with it (migration 0017).
-- NULL when the attempt was not traced. Replaced with the attempt's when a retry continues
-- the fan-out.
ALTER TABLE {schema}.fanouts ADD COLUMN traceparent text;
