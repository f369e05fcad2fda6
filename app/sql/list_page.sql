-- steprecord_list_page: one page of an instance's records, for GET .../steps.
--
-- Arguments: the instance's key; the order ('ordinal', or 'started_at': started records by
-- (started_at, id), then never-started ones by id); the keyset position after which the
-- page starts (p_after_ordinal for 'ordinal'; p_after_started_at and p_after_id for
-- 'started_at', where a NULL time means a position inside the never-started part); the
-- statuses to keep (NULL: all); p_max_rows, the most rows to answer (the caller asks for
-- one more than its page to learn whether another page follows); and p_max_bytes, the most
-- bytes of long values (output as text, error message, output URL) to answer, about.
--
-- Answer: the records as the API shows them, in the API's key order, with the instance's
-- key and the output as text; the service renders them as JSON. No row at all: the
-- instance does not exist. One row whose id is NULL: it exists but has no such record.
-- Then `cut`, after the record's columns: true on the last row when the rows answered so far
-- hold p_max_bytes of long values or more, and the function stopped there (more may follow:
-- the next page starts after that row). Rows are read one by one and counted as they come,
-- so a page of large outputs stops reading at the bound: neither the database nor the
-- service holds the 1,000 outputs of 1 MiB a page of `limit=1000` could name.
--
-- The instance is found by its id, derived from its key, and its key: on Citus the id names
-- the shard, so each read goes to the one worker that holds the instance (Citus plans this
-- function with its values there, app/ops/distribution.py).
--
-- Each of the three reads is one range scan of one index under its LIMIT, whatever the
-- parameters (a loop of PL/pgSQL reads its rows a few at a time, and stops reading there): (instance_id, ordinal), or (instance_id, started_at, id) twice, appended.
-- So the one generic plan per connection (force_generic_plan) is the plan a custom one
-- would be, and the statement is planned once per connection instead of on every call.
CREATE OR REPLACE FUNCTION steprecord_list_page(
    p_instance_key text, p_order text, p_after_ordinal integer,
    p_after_started_at timestamptz, p_after_id bigint, p_statuses text[],
    p_max_rows integer, p_max_bytes bigint
) RETURNS TABLE (
    id bigint, instance_key text, step_slug text, ordinal integer, status text,
    attempt_count integer, output text, external_output_url text,
    started_at timestamptz, completed_at timestamptz, lease_expires_at timestamptz,
    error_code text, error_message text, created_at timestamptz, updated_at timestamptz,
    updated_by text, cut boolean
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    v_bytes bigint := 0;
BEGIN
    cut := false;
    IF p_order = 'ordinal' THEN
        -- By ordinal, after p_after_ordinal.
        FOR id, instance_key, step_slug, ordinal, status, attempt_count, output,
            external_output_url, started_at, completed_at, lease_expires_at, error_code,
            error_message, created_at, updated_at, updated_by IN
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
          AND p.instance_key = p_instance_key
        LOOP
            v_bytes := v_bytes + coalesce(octet_length(output), 0)
                + coalesce(octet_length(error_message), 0)
                + coalesce(octet_length(external_output_url), 0);
            cut := v_bytes >= p_max_bytes;
            RETURN NEXT;
            EXIT WHEN cut;
        END LOOP;
    ELSIF p_after_started_at IS NULL THEN
        -- Inside the never-started part (started_at IS NULL sorts last): by id alone.
        FOR id, instance_key, step_slug, ordinal, status, attempt_count, output,
            external_output_url, started_at, completed_at, lease_expires_at, error_code,
            error_message, created_at, updated_at, updated_by IN
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
          AND p.instance_key = p_instance_key
        LOOP
            v_bytes := v_bytes + coalesce(octet_length(output), 0)
                + coalesce(octet_length(error_message), 0)
                + coalesce(octet_length(external_output_url), 0);
            cut := v_bytes >= p_max_bytes;
            RETURN NEXT;
            EXIT WHEN cut;
        END LOOP;
    ELSE
        -- Started records after (p_after_started_at, p_after_id), then the never-started
        -- ones from the first: two index range scans appended, so neither needs a sort.
        FOR id, instance_key, step_slug, ordinal, status, attempt_count, output,
            external_output_url, started_at, completed_at, lease_expires_at, error_code,
            error_message, created_at, updated_at, updated_by IN
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
          AND p.instance_key = p_instance_key
        LOOP
            v_bytes := v_bytes + coalesce(octet_length(output), 0)
                + coalesce(octet_length(error_message), 0)
                + coalesce(octet_length(external_output_url), 0);
            cut := v_bytes >= p_max_bytes;
            RETURN NEXT;
            EXIT WHEN cut;
        END LOOP;
    END IF;
END
$fn$;
