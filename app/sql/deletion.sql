-- Deleting instances (app/data/retention.py): one on request (`DELETE /v1/instances/{key}`),
-- or those last written before a cutoff (`steprecord prune`, STEPRECORD_RETENTION). Definer
-- functions (owner_rights.sql): the service's role deletes nothing itself. An instance goes
-- with its records in one statement; their history and repair log follow by ON DELETE
-- CASCADE.
--
-- Lock, then judge: two statements, the second of which takes its snapshot after the first's
-- lock was granted (at READ COMMITTED each statement of a VOLATILE function, as these are,
-- takes a new one), so it sees every step committed before, also one created by a writer
-- that held the instance's lock while the first waited (one statement that locked and judged
-- would judge on its own older snapshot, miss that step, and then fail on it, or delete it
-- unjudged). The second locks the
-- records too, in id order (a writer updating one finishes first, and the check of what is
-- running reads the newest versions). On Citus every statement names the instance's id, so it
-- runs on the one worker that holds the instance; distribution makes these functions plan each
-- statement with its values (app/ops/distribution.py), so Citus sees that id.

-- One instance, by its id and key: `present` false when there is no such instance; otherwise
-- its running steps and its repairs when it was judged, and `deleted` 1 when it went. Without
-- p_force an instance with a running step stays; without p_erase_repairs one whose repair log
-- holds entries stays.
CREATE OR REPLACE FUNCTION steprecord_delete_instance(
    p_instance_id bigint, p_instance_key text, p_force boolean, p_erase_repairs boolean
) RETURNS TABLE (present boolean, running bigint, repairs bigint, deleted bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    PERFORM FROM process_instance p
    WHERE p.id = p_instance_id AND p.instance_key = p_instance_key
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::bigint, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    RETURN QUERY
    WITH records AS (
        SELECT r.status FROM workflow_step_record r WHERE r.instance_id = p_instance_id
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    logged AS (
        SELECT count(*) AS n FROM workflow_step_repair x WHERE x.instance_id = p_instance_id
    ),
    allowed AS (
        SELECT WHERE (p_force OR NOT EXISTS (SELECT 1 FROM records WHERE status = 'running'))
                 AND (p_erase_repairs OR (SELECT n FROM logged) = 0)
    ),
    gone_records AS (
        DELETE FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id AND EXISTS (SELECT FROM allowed)
    ),
    gone AS (
        DELETE FROM process_instance p
        WHERE p.id = p_instance_id AND EXISTS (SELECT FROM allowed) RETURNING p.id
    )
    SELECT true,
           (SELECT count(*) FROM records WHERE status = 'running'),
           (SELECT n FROM logged),
           (SELECT count(*) FROM gone);
END
$fn$;

-- Pruning, a batch of instances in one transaction (app/data/retention.py, `lock_due`):
-- first every instance of the batch is locked (steprecord_prune_lock, in id order), then each
-- is judged (steprecord_prune_due, after all the locks were granted) and the archive read,
-- then the instances that go are deleted (steprecord_prune_delete).

-- Lock one instance (a writer creating a step of it waits from then on).
CREATE OR REPLACE FUNCTION steprecord_prune_lock(p_instance_id bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    PERFORM FROM process_instance p WHERE p.id = p_instance_id FOR UPDATE;
END
$fn$;

-- Judge one locked instance, locking its records in id order: a row when it goes, with what
-- goes with it. It goes when its last write (its records' greatest updated_at, else its own
-- created_at) is before p_cutoff and, unless p_include_unfinished, none of its records is
-- pending or running; so an instance written after the cutoff stays, even when it was
-- selected as a candidate before that write.
CREATE OR REPLACE FUNCTION steprecord_prune_due(
    p_instance_id bigint, p_cutoff timestamptz, p_include_unfinished boolean
) RETURNS TABLE (
    id bigint, instance_key text, created_at timestamptz, records bigint, attempts bigint
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    RETURN QUERY
    WITH locked AS (
        SELECT r.updated_at, r.status FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id
        ORDER BY r.id
        FOR UPDATE
    )
    SELECT p.id, p.instance_key, p.created_at,
           (SELECT count(*) FROM locked),
           (SELECT count(*) FROM workflow_step_attempt a WHERE a.instance_id = p_instance_id)
    FROM process_instance p
    WHERE p.id = p_instance_id
      AND COALESCE((SELECT max(l.updated_at) FROM locked l), p.created_at) < p_cutoff
      AND (p_include_unfinished
           OR NOT EXISTS (SELECT 1 FROM locked l WHERE l.status IN ('pending', 'running')));
END
$fn$;

-- Delete the judged instances of the batch with their records.
CREATE OR REPLACE FUNCTION steprecord_prune_delete(p_ids bigint[]) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    WITH gone_records AS (
        DELETE FROM workflow_step_record r WHERE r.instance_id = ANY (p_ids)
    )
    DELETE FROM process_instance p WHERE p.id = ANY (p_ids);
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_delete_instance FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_prune_lock FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_prune_due FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_prune_delete FROM PUBLIC;
