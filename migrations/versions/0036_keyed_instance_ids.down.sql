-- Revision 0036_keyed_instance_ids, downgrade: the same files as of revision 0035.
-- Made by `python -m app.sql freeze 0036_keyed_instance_ids`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- ===== app/sql/instance_id.sql as of revision 0035 =====
-- steprecord_instance_id: an instance's id, derived from its key.
--
-- The first 8 bytes of the SHA-256 of the key's UTF-8 bytes, as a signed bigint (big-endian,
-- two's complement).
--
-- Why derived: on Citus the instance's id is the distribution column of every per-instance
-- table, so whoever knows the key (the service, before its one call) knows the id, and so
-- the worker that holds the instance, without asking the database first.
--
-- Why SHA-256 (not a fast hash such as hashtextextended): a tenant chooses its keys, and must
-- not be able to choose one whose id is another tenant's instance's. Finding a key whose id
-- equals a given one is about 2^64 SHA-256 evaluations. Should two keys ever share an id, they
-- still never share rows: process_instance's primary key is the id, and the CHECK
-- ck_process_instance_id_derived ties the id to its key, so the second key's instance cannot
-- be created; the judge answers its events `instance_key_collision` (steprecord_apply_events).
--
-- IMMUTABLE: the id of a key never changes (convert_to names its encoding; keys are ASCII).
-- PostgreSQL does not inline it (convert_to is STABLE, and an IMMUTABLE function whose body
-- calls a STABLE one is not inlined: EXPLAIN VERBOSE shows the call), so a statement calls it
-- once per key it computes; given a constant key, the planner computes it once, when it plans.
CREATE OR REPLACE FUNCTION steprecord_instance_id(p_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT ('x' || left(encode(sha256(convert_to(p_key, 'UTF8')), 'hex'), 16))::bit(64)::bigint
$fn$;
