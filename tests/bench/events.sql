-- pgbench, single events: what PostgreSQL itself needs for the events events.lua sends.
-- One run of this script is two events, each its own transaction: the `start` of a new step
-- (:r) and the `complete` of the step this client started in its previous run (:prev, set
-- with `-D prev=0` for the first run, whose complete then creates the record). Each event
-- upserts the instance (its id derived from its key, steprecord_instance_id, as the table's
-- CHECK demands; ON CONFLICT with no target, since a concurrent insert of the same instance
-- may collide on either unique index, the id's or the key's), takes the next ordinal from
-- the instance's counter (its row lock is the per-instance lock) and upserts the record; a
-- replayed start changes nothing and a complete only moves a running attempt-1 record to
-- completed, as the transition trigger demands. Variables: instances (-D), client_id
-- (pgbench's own).
\set r random(1, 2000000000)
\set k :r % :instances + 1
\set pk :prev % :instances + 1
BEGIN;
INSERT INTO process_instance (id, instance_key)
VALUES (steprecord_instance_id('e' || :k), 'e' || :k)
ON CONFLICT DO NOTHING;
WITH p AS (
    UPDATE process_instance SET next_ordinal = next_ordinal + 1
    WHERE instance_key = 'e' || :k
    RETURNING id, next_ordinal - 1 AS ordinal
)
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at)
SELECT p.id, 's' || :client_id || '-' || :r, p.ordinal, 'running', 1, now() FROM p
ON CONFLICT (instance_id, step_slug) DO NOTHING;
COMMIT;
BEGIN;
INSERT INTO process_instance (id, instance_key)
VALUES (steprecord_instance_id('e' || :pk), 'e' || :pk)
ON CONFLICT DO NOTHING;
WITH p AS (
    UPDATE process_instance SET next_ordinal = next_ordinal + 1
    WHERE instance_key = 'e' || :pk
    RETURNING id, next_ordinal - 1 AS ordinal
)
INSERT INTO workflow_step_record AS r (instance_id, step_slug, ordinal, status, attempt_count,
                                       output, started_at, completed_at)
SELECT p.id, 's' || :client_id || '-' || :prev, p.ordinal, 'completed', 1,
       '{"a":1,"b":"x","n":123}', now(), now() FROM p
ON CONFLICT (instance_id, step_slug) DO UPDATE
SET status = 'completed', output = excluded.output, completed_at = excluded.completed_at,
    updated_at = excluded.updated_at
WHERE r.status = 'running' AND r.attempt_count = 1;
COMMIT;
\set prev :r
