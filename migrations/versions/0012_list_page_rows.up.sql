-- Revision 0012, upgrade: the frozen text this migration installs,
-- exactly as it was first applied. Never edit it: the current source of each
-- function is in app/sql/, and a change there ships in a new migration.

        CREATE FUNCTION steprecord_list_page(
            p_instance_key text, p_order text, p_after_ordinal integer,
            p_after_started_at timestamptz, p_after_id bigint, p_statuses text[],
            p_max_rows integer
        ) RETURNS TABLE (
            id bigint, instance_key text, step_slug text, ordinal integer, status text,
            attempt_count integer, output text, external_output_url text,
            started_at timestamptz, completed_at timestamptz, lease_expires_at timestamptz,
            error_code text, error_message text, created_at timestamptz, updated_at timestamptz
        )
        LANGUAGE plpgsql STABLE
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            IF p_order = 'ordinal' THEN
                RETURN QUERY 
    SELECT r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output::text, r.external_output_url, r.started_at, r.completed_at, r.lease_expires_at, r.error_code, r.error_message, r.created_at, r.updated_at
    FROM process_instance p
    LEFT JOIN LATERAL (
        SELECT * FROM workflow_step_record r
        WHERE r.instance_id = p.id AND r.ordinal > p_after_ordinal AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
        ORDER BY r.ordinal
        LIMIT p_max_rows
    ) r ON true
    WHERE p.instance_key = p_instance_key
;
            ELSIF p_after_started_at IS NULL THEN
                RETURN QUERY 
    SELECT r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output::text, r.external_output_url, r.started_at, r.completed_at, r.lease_expires_at, r.error_code, r.error_message, r.created_at, r.updated_at
    FROM process_instance p
    LEFT JOIN LATERAL 
    (SELECT * FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > p_after_id AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
     ORDER BY r.started_at, r.id
     LIMIT p_max_rows)
 r ON true
    WHERE p.instance_key = p_instance_key
;
            ELSE
                RETURN QUERY 
    SELECT r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output::text, r.external_output_url, r.started_at, r.completed_at, r.lease_expires_at, r.error_code, r.error_message, r.created_at, r.updated_at
    FROM process_instance p
    LEFT JOIN LATERAL (
        
    (SELECT * FROM workflow_step_record r
     WHERE r.instance_id = p.id
       AND (r.started_at, r.id) > (p_after_started_at, p_after_id) AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
     ORDER BY r.started_at, r.id
     LIMIT p_max_rows)
 UNION ALL 
    (SELECT * FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > 0 AND (p_statuses IS NULL OR r.status = ANY(p_statuses))
     ORDER BY r.started_at, r.id
     LIMIT p_max_rows)
 LIMIT p_max_rows
    ) r ON true
    WHERE p.instance_key = p_instance_key
;
            END IF;
        END
        $fn$;
