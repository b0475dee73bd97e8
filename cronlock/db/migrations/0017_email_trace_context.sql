-- Tracing (docs/tracing.md): the W3C `traceparent` of the run that queued an email, when that
-- run was traced, so that the sender's provider request can link to it. NULL otherwise. Plain
-- text: the sender hands it to OpenTelemetry's parser, which ignores a malformed value.
ALTER TABLE {schema}.email_outbox ADD COLUMN traceparent text;
