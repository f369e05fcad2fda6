-- pgbench, single events at the design's limit: the two events of events.sql (the `start` of
-- a new step, :r, and the `complete` of the step this client started in its previous run,
-- :prev) passed to the service's one-event judge, `steprecord_apply_event`, with the
-- arguments the service passes for the same requests of events.lua (app/data/judge.py:
-- the index, then each field of PARAMS; the trailing trace id keeps its default, NULL, as
-- for a request without one). Each call is its own transaction, as each request is. What
-- the service costs beyond this is what it adds on top of the database's own work.
-- Variables: instances, prev (-D), client_id (pgbench's own).
\set r random(1, 2000000000)
\set k :r % :instances + 1
\set pk :prev % :instances + 1
SELECT * FROM steprecord_apply_event(0::int, ('e' || :k)::text, ('s' || :client_id || '-' || :r)::text, 'start'::text, 1::bigint, now()::timestamptz, NULL::timestamptz, NULL::text, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::int);
SELECT * FROM steprecord_apply_event(0::int, ('e' || :pk)::text, ('s' || :client_id || '-' || :prev)::text, 'complete'::text, 1::bigint, now()::timestamptz, now()::timestamptz, '{"a":1,"b":"x","n":123}'::text, NULL::text, NULL::text, NULL::text, NULL::bigint, NULL::int);
\set prev :r
