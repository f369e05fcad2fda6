-- steprecord_instance_id: an instance's id, derived from its key.
--
-- The first 8 bytes of the HMAC-SHA-256 of the key's UTF-8 bytes under this database's own
-- secret, as a signed bigint (big-endian, two's complement). The secret is made at random by
-- the migrate that creates it (revision 0036) and lives in the function
-- steprecord_instance_id_key(), which returns the HMAC's two padded keys, (K xor ipad) ||
-- (K xor opad), 128 bytes: it is this database's, not the source's, so app/sql/ does not
-- hold it. A dump carries it (it is part of the schema), so a restored database keeps its ids.
--
-- Why derived: on Citus the instance's id is the distribution column of every per-instance
-- table, so whoever can ask the database (the service, in the statement of its one call)
-- knows the id, and so the worker that holds the instance, without reading a row first.
--
-- Why keyed: a tenant chooses its keys, and must not be able to choose one whose id is the id
-- another tenant's instance will have (the second key's instance cannot be created, so that
-- instance would be blocked). Without the secret the id of a key cannot be computed at all,
-- so no key can be aimed at a future key's id; by a plain hash, about 2^64 SHA-256
-- evaluations, divided by the number of keys one can guess, would find one. Should two keys
-- ever share an id, they still never share rows: process_instance's primary key is the id,
-- and the CHECK ck_process_instance_id_derived ties the id to its key, so the second key's
-- instance cannot be created; the judge answers its events `instance_key_collision`.
--
-- The secret's function is named with its schema: a CHECK calls this function wherever a row
-- is written, also where the search_path is empty (pg_restore, and the apply worker of the
-- logical replication that moves a shard on Citus), and an unqualified name is not found there.
--
-- IMMUTABLE: the id of a key never changes (keys are ASCII, by the CHECK
-- ck_process_instance_instance_key_format; the secret is a constant, replaced only by a
-- migration that rewrites every id with it).
--
-- Written so that PostgreSQL inlines it (revision 0039): one expression of IMMUTABLE functions
-- only, no FROM. The key's bytes are `decode(replace(p_key, '\', '\\'), 'escape')`: the
-- text's own bytes in the database's encoding (every backslash doubled, so `escape` reads
-- none as an escape), which are its UTF-8 bytes in a UTF8 database and, for an ASCII key, in
-- any encoding; revision 0036's `convert_to(p_key, 'UTF8')` gave the same bytes, but is
-- STABLE, so the function was not inlined and every call ran its body as a query of its own
-- (parsed, planned and run each time, and on Citus through Citus's planner and executor
-- too): about a third of a replayed event's CPU on one node. Inlined, a statement or a PL/pgSQL
-- expression that calls it with a parameter (the judge's own `v_id`) computes the two
-- SHA-256 in its kept plan; given a constant key, the planner still computes it once, when
-- it plans (then PostgreSQL runs the body as a query once, as before).
CREATE OR REPLACE FUNCTION steprecord_instance_id(p_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT ('x' || left(encode(sha256(
        substr(public.steprecord_instance_id_key(), 65, 64)
        || sha256(substr(public.steprecord_instance_id_key(), 1, 64)
                  || decode(replace(p_key, '\', '\\'), 'escape'))
    ), 'hex'), 16))::bit(64)::bigint
$fn$;
