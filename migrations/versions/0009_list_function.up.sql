-- Revision 0009, upgrade: the frozen text this migration installs,
-- exactly as it was first applied. Never edit it: the current source of each
-- function is in app/sql/, and a change there ships in a new migration.

        CREATE FUNCTION steprecord_list_steps(
            p_instance_key text, p_order text, p_after_ordinal integer,
            p_after_started_at timestamptz, p_after_id bigint, p_statuses text[],
            p_page_size integer, p_summary boolean
        ) RETURNS TABLE (
            found bigint, items text, last_ordinal integer, last_started_at timestamptz,
            last_id bigint
        )
        LANGUAGE plpgsql STABLE
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            IF p_order = 'ordinal' THEN
                RETURN QUERY 
        SELECT count(*),
               array_to_string((array_agg(q.j ORDER BY q.ordinal))[1:p_page_size], ','),
               CASE WHEN count(q.id) > p_page_size THEN (array_agg(q.ordinal ORDER BY q.ordinal))[p_page_size] END, NULL::timestamptz, NULL::bigint
        FROM (
            SELECT s.id, s.ordinal, s.started_at,
                   CASE WHEN s.id IS NULL THEN NULL
                        WHEN p_summary THEN (SELECT row_to_json(x)::text FROM (SELECT s.id AS id, p_instance_key AS instance_key, s.step_slug AS step_slug, s.ordinal AS ordinal, s.status AS status, s.attempt_count AS attempt_count, s.external_output_url AS external_output_url, to_char(s.started_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.started_at) = s.started_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS started_at, to_char(s.completed_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.completed_at) = s.completed_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS completed_at, to_char(s.lease_expires_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.lease_expires_at) = s.lease_expires_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS lease_expires_at, s.error_code AS error_code, to_char(s.created_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.created_at) = s.created_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS created_at, to_char(s.updated_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.updated_at) = s.updated_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS updated_at) x)
                        ELSE (SELECT row_to_json(x)::text FROM (SELECT s.id AS id, p_instance_key AS instance_key, s.step_slug AS step_slug, s.ordinal AS ordinal, s.status AS status, s.attempt_count AS attempt_count, s.output AS output, s.external_output_url AS external_output_url, to_char(s.started_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.started_at) = s.started_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS started_at, to_char(s.completed_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.completed_at) = s.completed_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS completed_at, to_char(s.lease_expires_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.lease_expires_at) = s.lease_expires_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS lease_expires_at, s.error_code AS error_code, s.error_message AS error_message, to_char(s.created_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.created_at) = s.created_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS created_at, to_char(s.updated_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.updated_at) = s.updated_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS updated_at) x) END AS j
            FROM process_instance p
            LEFT JOIN LATERAL (
    SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output, r.external_output_url, r.started_at, r.completed_at, r.error_code, r.error_message, r.created_at, r.updated_at, r.lease_expires_at FROM workflow_step_record r
    WHERE r.instance_id = p.id AND r.ordinal > p_after_ordinal AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
    ORDER BY r.ordinal
    LIMIT p_page_size + 1
) s ON true
            WHERE p.instance_key = p_instance_key
        ) q
    ;
            ELSIF p_after_started_at IS NULL THEN
                RETURN QUERY 
        SELECT count(*),
               array_to_string((array_agg(q.j ORDER BY q.started_at, q.id))[1:p_page_size], ','),
               NULL::integer, CASE WHEN count(q.id) > p_page_size THEN (array_agg(q.started_at ORDER BY q.started_at, q.id))[p_page_size] END, CASE WHEN count(q.id) > p_page_size THEN (array_agg(q.id ORDER BY q.started_at, q.id))[p_page_size] END
        FROM (
            SELECT s.id, s.ordinal, s.started_at,
                   CASE WHEN s.id IS NULL THEN NULL
                        WHEN p_summary THEN (SELECT row_to_json(x)::text FROM (SELECT s.id AS id, p_instance_key AS instance_key, s.step_slug AS step_slug, s.ordinal AS ordinal, s.status AS status, s.attempt_count AS attempt_count, s.external_output_url AS external_output_url, to_char(s.started_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.started_at) = s.started_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS started_at, to_char(s.completed_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.completed_at) = s.completed_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS completed_at, to_char(s.lease_expires_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.lease_expires_at) = s.lease_expires_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS lease_expires_at, s.error_code AS error_code, to_char(s.created_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.created_at) = s.created_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS created_at, to_char(s.updated_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.updated_at) = s.updated_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS updated_at) x)
                        ELSE (SELECT row_to_json(x)::text FROM (SELECT s.id AS id, p_instance_key AS instance_key, s.step_slug AS step_slug, s.ordinal AS ordinal, s.status AS status, s.attempt_count AS attempt_count, s.output AS output, s.external_output_url AS external_output_url, to_char(s.started_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.started_at) = s.started_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS started_at, to_char(s.completed_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.completed_at) = s.completed_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS completed_at, to_char(s.lease_expires_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.lease_expires_at) = s.lease_expires_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS lease_expires_at, s.error_code AS error_code, s.error_message AS error_message, to_char(s.created_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.created_at) = s.created_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS created_at, to_char(s.updated_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.updated_at) = s.updated_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS updated_at) x) END AS j
            FROM process_instance p
            LEFT JOIN LATERAL (
    (SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output, r.external_output_url, r.started_at, r.completed_at, r.error_code, r.error_message, r.created_at, r.updated_at, r.lease_expires_at FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > p_after_id AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
     ORDER BY r.started_at, r.id
     LIMIT p_page_size + 1)
) s ON true
            WHERE p.instance_key = p_instance_key
        ) q
    ;
            ELSE
                RETURN QUERY 
        SELECT count(*),
               array_to_string((array_agg(q.j ORDER BY q.started_at, q.id))[1:p_page_size], ','),
               NULL::integer, CASE WHEN count(q.id) > p_page_size THEN (array_agg(q.started_at ORDER BY q.started_at, q.id))[p_page_size] END, CASE WHEN count(q.id) > p_page_size THEN (array_agg(q.id ORDER BY q.started_at, q.id))[p_page_size] END
        FROM (
            SELECT s.id, s.ordinal, s.started_at,
                   CASE WHEN s.id IS NULL THEN NULL
                        WHEN p_summary THEN (SELECT row_to_json(x)::text FROM (SELECT s.id AS id, p_instance_key AS instance_key, s.step_slug AS step_slug, s.ordinal AS ordinal, s.status AS status, s.attempt_count AS attempt_count, s.external_output_url AS external_output_url, to_char(s.started_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.started_at) = s.started_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS started_at, to_char(s.completed_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.completed_at) = s.completed_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS completed_at, to_char(s.lease_expires_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.lease_expires_at) = s.lease_expires_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS lease_expires_at, s.error_code AS error_code, to_char(s.created_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.created_at) = s.created_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS created_at, to_char(s.updated_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.updated_at) = s.updated_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS updated_at) x)
                        ELSE (SELECT row_to_json(x)::text FROM (SELECT s.id AS id, p_instance_key AS instance_key, s.step_slug AS step_slug, s.ordinal AS ordinal, s.status AS status, s.attempt_count AS attempt_count, s.output AS output, s.external_output_url AS external_output_url, to_char(s.started_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.started_at) = s.started_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS started_at, to_char(s.completed_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.completed_at) = s.completed_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS completed_at, to_char(s.lease_expires_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.lease_expires_at) = s.lease_expires_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS lease_expires_at, s.error_code AS error_code, s.error_message AS error_message, to_char(s.created_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.created_at) = s.created_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS created_at, to_char(s.updated_at AT TIME ZONE 'UTC', CASE WHEN date_trunc('second', s.updated_at) = s.updated_at THEN 'YYYY-MM-DD"T"HH24:MI:SS"Z"' ELSE 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"' END) AS updated_at) x) END AS j
            FROM process_instance p
            LEFT JOIN LATERAL (
    (SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output, r.external_output_url, r.started_at, r.completed_at, r.error_code, r.error_message, r.created_at, r.updated_at, r.lease_expires_at FROM workflow_step_record r
     WHERE r.instance_id = p.id
       AND (r.started_at, r.id) > (p_after_started_at, p_after_id) AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
     ORDER BY r.started_at, r.id
     LIMIT p_page_size + 1)
 UNION ALL 
    (SELECT r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output, r.external_output_url, r.started_at, r.completed_at, r.error_code, r.error_message, r.created_at, r.updated_at, r.lease_expires_at FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > 0 AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
     ORDER BY r.started_at, r.id
     LIMIT p_page_size + 1)
 LIMIT p_page_size + 1) s ON true
            WHERE p.instance_key = p_instance_key
        ) q
    ;
            END IF;
        END
        $fn$;
