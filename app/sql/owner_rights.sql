-- Who may write the records: the owner of the schema, and every other role only through the
-- judge's functions.
--
-- The fact tables (process_instance, workflow_step_record), the history
-- (workflow_step_attempt) and the repair log (workflow_step_repair) are written by their
-- owner, the role that migrates. The service may run as another role (`steprecord grant
-- ROLE`, docs/operations.md "Database roles") that holds SELECT on them and no write right
-- at all: it writes only by calling the functions below, which run with their owner's rights
-- (SECURITY DEFINER, with a fixed search_path so that no object of the caller's can stand in
-- for one of the schema's) and judge every write themselves:
--   steprecord_apply_event, steprecord_apply_events, steprecord_heartbeat (the judge),
--   steprecord_reopen (an operator's repair), steprecord_sweep_instance (the sweeper),
--   steprecord_delete_instance and steprecord_prune_* (deletion), steprecord_patch_labels
--   (an instance's labels), steprecord_shard_judge (on Citus, the judge's copy for a
--   shard, shard_judge.sql).
-- Each file revokes its functions from PUBLIC: only the owner, and the roles it granted
-- EXECUTE, call them.
--
-- The guards (record_guard.sql, attempt_history.sql, repair_log.sql) let the judge or a
-- repair write what no one else may (a late report's history entry, a reopen, a repair log
-- entry) when the transaction says so in `steprecord.writer`, a setting any session can
-- change. They trust it only from a role that holds the schema owner's rights (the owner, a
-- member of it, a superuser): the definer functions above, and the owner's own hand-written
-- repairs (audited as any other). A role granted write rights on a table later still cannot
-- pass for the judge.

-- Whether the current role (inside a definer function: the function's owner) holds the
-- rights of the schema's owner: the role that migrated it, which owns its functions, this one
-- among them, and its tables (on Citus their shards too). Asked of this function's owner, not
-- of a trigger's table: Citus hides a worker's shards from pg_class in a client's session, so
-- a guard running on a shard would not find its own table there.
CREATE OR REPLACE FUNCTION steprecord_by_owner() RETURNS boolean
LANGUAGE sql STABLE
AS $fn$
    SELECT coalesce((SELECT pg_has_role(current_user, p.proowner, 'USAGE')
                     FROM pg_catalog.pg_proc p
                     WHERE p.oid = 'public.steprecord_by_owner()'::pg_catalog.regprocedure),
                    false)
$fn$;
