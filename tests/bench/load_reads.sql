-- The read benchmark's table (run.py passes `instances`): keys r1, r2, ... with 100, 300, 700
-- or 900 steps each (500 on average). Records are written step by step across all instances
-- (ordinal, then instance), so an instance's records are spread over the table as they are
-- when many runs progress at once. Statuses: the last 5 percent of each instance's steps pending
-- (never started), every 17th running, every 23rd failed, the rest completed with a small
-- inline output. started_at is a permutation of the ordinals, so the two orders differ.
INSERT INTO process_instance (id, instance_key, next_ordinal)
SELECT steprecord_instance_id('r' || i), 'r' || i, (ARRAY[100, 300, 700, 900])[mod(i, 4) + 1]
FROM generate_series(1, %(instances)s) i;

INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  output, started_at, completed_at, error_code, error_message)
SELECT p.id, 'step-' || o, o, s.status, 1,
       CASE WHEN s.status = 'completed' THEN jsonb_build_object('a', 1, 'b', 'x', 'n', o) END,
       CASE WHEN s.status <> 'pending' THEN s.started_at END,
       CASE WHEN s.status IN ('completed', 'failed') THEN s.started_at + interval '1 s' END,
       CASE WHEN s.status = 'failed' THEN 'E_BENCH' END,
       CASE WHEN s.status = 'failed' THEN 'failed on purpose' END
FROM generate_series(0, 899) o
JOIN process_instance p ON o < p.next_ordinal
CROSS JOIN LATERAL (
    SELECT CASE WHEN o >= p.next_ordinal * 0.95 THEN 'pending'
                WHEN mod(o, 17) = 0 THEN 'running'
                WHEN mod(o, 23) = 0 THEN 'failed'
                ELSE 'completed' END AS status,
           timestamptz '2026-01-01 00:00:00Z'
               + make_interval(secs => mod(o * 7919, p.next_ordinal)) AS started_at
) s
ORDER BY o, p.id;
