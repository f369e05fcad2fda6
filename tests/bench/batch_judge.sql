-- pgbench, batches through the service's judge: the events of one batch.lua request (:size,
-- half `start` of new steps, half `complete` of the steps this client started in its
-- previous run, as batch.sql) passed to `steprecord_apply_events` as the service passes them,
-- one array per field, here built in SQL. Compared with batch.sql, it shows what judging
-- costs PostgreSQL beyond the least SQL the same writes need (tests/bench/cpu.py runs both).
-- Variables: instances, size, prev (-D), client_id (pgbench's own).
\set r random(1, 2000000000)
\set half :size / 2
SELECT count(*) FROM steprecord_apply_events(
  (SELECT array_agg(g - 1 ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg('b' || ((CASE WHEN g <= :half THEN :r ELSE :prev END + ((g - 1) % :half + 1) * 7919) % :instances + 1) ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg('s' || :client_id || '-' || (CASE WHEN g <= :half THEN :r ELSE :prev END) || '-' || ((g - 1) % :half + 1) ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(CASE WHEN g <= :half THEN 'start' ELSE 'complete' END ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(1::bigint) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(now() ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(CASE WHEN g <= :half THEN NULL ELSE now() END ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(CASE WHEN g <= :half THEN NULL ELSE '{"a":1,"b":"x","n":123}' END ORDER BY g) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(NULL::text) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(NULL::text) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(NULL::text) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(NULL::bigint) FROM generate_series(1, 2 * :half) g),
  (SELECT array_agg(NULL::int) FROM generate_series(1, 2 * :half) g));
\set prev :r
