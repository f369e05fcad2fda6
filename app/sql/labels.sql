-- steprecord_patch_labels: PATCH /v1/instances/{instance_key}, an instance's labels merged as
-- JSON Merge Patch (RFC 7396): the keys of p_set take their values, the keys of p_remove (those
-- the patch set to null) go, every other label stays.
--
-- One UPDATE of the instance's row, found by its id (derived from its key, so that on Citus
-- the statement goes to the one shard that holds it) and its key. The new labels are computed
-- from the row's newest version under its row lock, so two concurrent patches never lose each
-- other's keys, and an event's labels merged meanwhile by the judge (apply_event.sql) stay.
-- The labels' CHECKs (ck_process_instance_labels_*) refuse a result over a limit (33 labels).
--
-- Answer: the instance's id, or no row when no instance has that key. A definer function, as
-- every write of the service (owner_rights.sql).
CREATE OR REPLACE FUNCTION steprecord_patch_labels(
    p_instance_key text, p_set jsonb, p_remove text[]
) RETURNS TABLE (id bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE process_instance p
    SET labels = (p.labels || p_set) - p_remove
    WHERE p.id = steprecord_instance_id(p_instance_key) AND p.instance_key = p_instance_key
    RETURNING p.id;
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_patch_labels FROM PUBLIC;
