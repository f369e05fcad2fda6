-- pgbench, batches: the events of one batch.lua request (:size, half `start` of new steps,
-- half `complete` of the steps this client started in its previous run) in one transaction
-- of two set-based statements: upsert the instances (each id derived from its key,
-- steprecord_instance_id, as the table's CHECK demands; ON CONFLICT with no target, since a
-- concurrent insert of the same instance may collide on either unique index), then take the
-- ordinals from the instances' counters and upsert the records in one INSERT ... SELECT ...
-- ON CONFLICT.
-- Instances are locked and inserted in key order, so concurrent batches cannot deadlock.
-- Variables: instances, size, prev (-D), client_id (pgbench's own).
\set r random(1, 2000000000)
\set half :size / 2
BEGIN;
INSERT INTO process_instance (id, instance_key)
SELECT steprecord_instance_id(k), k
FROM (SELECT DISTINCT 'b' || ((s.r + g * 7919) % :instances + 1) AS k
      FROM (VALUES (:r::bigint), (:prev::bigint)) s (r), generate_series(1, :half) g) keys
ORDER BY k
ON CONFLICT DO NOTHING;
WITH ev AS (
    SELECT 'b' || ((s.r + g * 7919) % :instances + 1) AS instance_key,
           's' || :client_id || '-' || s.r || '-' || g AS step_slug, s.status
    FROM (VALUES (:r::bigint, 'running'), (:prev::bigint, 'completed')) s (r, status),
         generate_series(1, :half) g
),
n AS (SELECT instance_key, count(*) AS c FROM ev GROUP BY instance_key),
locked AS (
    SELECT p.id, n.c FROM process_instance p JOIN n USING (instance_key)
    ORDER BY p.instance_key FOR UPDATE OF p
),
p AS (
    UPDATE process_instance p SET next_ordinal = p.next_ordinal + locked.c
    FROM locked WHERE p.id = locked.id
    RETURNING p.id, p.instance_key, p.next_ordinal - locked.c AS first
)
INSERT INTO workflow_step_record AS r (instance_id, step_slug, ordinal, status, attempt_count,
                                       output, started_at, completed_at)
SELECT p.id, ev.step_slug,
       p.first + row_number() OVER (PARTITION BY p.id ORDER BY ev.step_slug) - 1, ev.status, 1,
       CASE WHEN ev.status = 'completed' THEN '{"a":1,"b":"x","n":123}'::jsonb END,
       now(), CASE WHEN ev.status = 'completed' THEN now() END
FROM ev JOIN p USING (instance_key)
ON CONFLICT (instance_id, step_slug) DO UPDATE
SET status = 'completed', output = excluded.output, completed_at = excluded.completed_at,
    updated_at = excluded.updated_at
WHERE r.status = 'running' AND r.attempt_count = 1 AND excluded.status = 'completed';
COMMIT;
\set prev :r
