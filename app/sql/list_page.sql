-- steprecord_list_page: one page of an instance's records, for GET .../steps.
--
-- Arguments: the instance's key; the order ('ordinal', or 'started_at': started records by
-- (started_at, id), then never-started ones by id); the keyset position after which the
-- page starts (p_after_ordinal for 'ordinal'; p_after_started_at and p_after_id for
-- 'started_at', where a NULL time means a position inside the never-started part); the
-- statuses to keep (NULL: all); and p_max_rows, the most rows to answer (the caller asks
-- for one more than its page to learn whether another page follows).
--
-- Answer: the records as the API shows them, in the API's key order, with the instance's
-- key and the output as text; the service renders them as JSON. No row at all: the
-- instance does not exist. One row whose id is NULL: it exists but has no such record.
--
-- The instance is found by its id, derived from its key, and its key: on Citus the id names
-- the shard, so each read goes to the one worker that holds the instance (Citus plans this
-- function with its values there, app/distribution.py).
--
-- Each of the three reads is one range scan of one index under its LIMIT, whatever the
-- parameters: (instance_id, ordinal), or (instance_id, started_at, id) twice, appended.
-- So the one generic plan per connection (force_generic_plan) is the plan a custom one
-- would be, and the statement is planned once per connection instead of on every call.
CREATE OR REPLACE FUNCTION steprecord_list_page(
    p_instance_key text, p_order text, p_after_ordinal integer,
    p_after_started_at timestamptz, p_after_id bigint, p_statuses text[],
    p_max_rows integer
) RETURNS TABLE (
    id bigint, instance_key text, step_slug text, ordinal integer, status text,
    attempt_count integer, output text, external_output_url text,
    started_at timestamptz, completed_at timestamptz, lease_expires_at timestamptz,
    error_code text, error_message text, created_at timestamptz, updated_at timestamptz,
    updated_by text
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    IF p_order = 'ordinal' THEN
        -- By ordinal, after p_after_ordinal.
        RETURN QUERY
        SELECT r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text, r.external_output_url, r.started_at, r.completed_at,
               r.lease_expires_at, r.error_code, r.error_message, r.created_at, r.updated_at,
               r.updated_by
        FROM process_instance p
        LEFT JOIN LATERAL (
            SELECT * FROM workflow_step_record r
            WHERE r.instance_id = steprecord_instance_id(p_instance_key)
              AND r.ordinal > p_after_ordinal
              AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
            ORDER BY r.ordinal
            LIMIT p_max_rows
        ) r ON true
        WHERE p.id = steprecord_instance_id(p_instance_key)
          AND p.instance_key = p_instance_key;
    ELSIF p_after_started_at IS NULL THEN
        -- Inside the never-started part (started_at IS NULL sorts last): by id alone.
        RETURN QUERY
        SELECT r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text, r.external_output_url, r.started_at, r.completed_at,
               r.lease_expires_at, r.error_code, r.error_message, r.created_at, r.updated_at,
               r.updated_by
        FROM process_instance p
        LEFT JOIN LATERAL (
            SELECT * FROM workflow_step_record r
            WHERE r.instance_id = steprecord_instance_id(p_instance_key) AND r.started_at IS NULL
              AND r.id > p_after_id AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
            ORDER BY r.started_at, r.id
            LIMIT p_max_rows
        ) r ON true
        WHERE p.id = steprecord_instance_id(p_instance_key)
          AND p.instance_key = p_instance_key;
    ELSE
        -- Started records after (p_after_started_at, p_after_id), then the never-started
        -- ones from the first: two index range scans appended, so neither needs a sort.
        RETURN QUERY
        SELECT r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text, r.external_output_url, r.started_at, r.completed_at,
               r.lease_expires_at, r.error_code, r.error_message, r.created_at, r.updated_at,
               r.updated_by
        FROM process_instance p
        LEFT JOIN LATERAL (
            (SELECT * FROM workflow_step_record r
             WHERE r.instance_id = steprecord_instance_id(p_instance_key)
               AND (r.started_at, r.id) > (p_after_started_at, p_after_id)
               AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
             ORDER BY r.started_at, r.id
             LIMIT p_max_rows)
            UNION ALL
            (SELECT * FROM workflow_step_record r
             WHERE r.instance_id = steprecord_instance_id(p_instance_key) AND r.started_at IS NULL
               AND r.id > 0 AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
             ORDER BY r.started_at, r.id
             LIMIT p_max_rows)
            LIMIT p_max_rows
        ) r ON true
        WHERE p.id = steprecord_instance_id(p_instance_key)
          AND p.instance_key = p_instance_key;
    END IF;
END
$fn$;
