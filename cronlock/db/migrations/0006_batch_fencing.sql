-- With EMAIL_BATCH_SIZE above 1, only rows never attempted are formed into batches; a row
-- whose own key may already have reached the provider (a retried row, or a dead one that was
-- re-queued: attempts reset, last error kept) goes on being sent alone under that key, or it
-- could be delivered twice. Batch senders claim those rows with this scan, which would
-- otherwise read every fresh row of a big backlog on each poll to find none.
CREATE INDEX email_outbox_due_alone ON {schema}.email_outbox (next_attempt_at, id)
    WHERE status = 'pending' AND batch_id IS NULL AND (attempts > 0 OR last_error IS NOT NULL);
