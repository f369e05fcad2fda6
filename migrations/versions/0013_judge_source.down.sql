-- Revision 0013, downgrade: the functions as revision 0012 left them (their text from
-- pg_get_functiondef of a database at 0012), steprecord_list_steps included. Never edit it.

CREATE OR REPLACE FUNCTION public.api_token_require_tokens()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        BEGIN
            INSERT INTO access_policy (tokens_required) VALUES (true)
            ON CONFLICT (id) DO UPDATE SET tokens_required = true, updated_at = now()
            WHERE NOT access_policy.tokens_required;
            RETURN NULL;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.steprecord_apply_event(integer, text, text, text, bigint, timestamp with time zone, timestamp with time zone, text, text, text, text, bigint, integer)
 RETURNS TABLE(i integer, outcome text, id bigint, step_slug text, ordinal integer, status text, attempt_count integer, output text, external_output_url text, started_at timestamp with time zone, completed_at timestamp with time zone, error_code text, error_message text, created_at timestamp with time zone, updated_at timestamp with time zone, lease_expires_at timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
        #variable_conflict use_column
        
        DECLARE
            judged record;
        BEGIN
            
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at, x.completed_at,
               x.output::jsonb AS output, x.url, x.error_code, x.error_message, x.ordinal,
               clock_timestamp() + x.lease_seconds * interval '1 second' AS lease_expires_at,
               clock_timestamp() AS now,
               CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
               CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                           WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
            AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
                 error_code, error_message, ordinal, lease_seconds)
    ),
    known AS (
        SELECT p.id, p.instance_key FROM process_instance p
        WHERE p.instance_key IN (SELECT instance_key FROM e)
    ),
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN known ON known.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = known.id AND r.step_slug = e.step_slug
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    dec AS (
        SELECT cur.i, cur.id, p.a_e, s.started_at,
            CASE
                WHEN (p.a_e, e.k) > (cur.attempt_count, p.rank) THEN
                    CASE WHEN p.a_e > 2147483647 THEN 'conflict'
                         WHEN e.k = 2 AND s.started_at IS NULL THEN 'not_started'
                         ELSE 'applied' END
                WHEN (p.a_e, e.k) = (cur.attempt_count, p.rank) THEN
                    CASE WHEN e.k < 2 THEN 'replay'
                         WHEN cur.status = e.target
                              AND cur.output IS NOT DISTINCT FROM e.output
                              AND cur.external_output_url IS NOT DISTINCT FROM e.url
                              AND cur.error_code IS NOT DISTINCT FROM e.error_code
                              AND cur.error_message IS NOT DISTINCT FROM e.error_message
                         THEN 'replay'
                         ELSE 'conflict' END
                WHEN p.a_e = cur.attempt_count THEN 'replay'
                ELSE 'stale_attempt'
            END AS outcome
        FROM cur JOIN e ON e.i = cur.i,
            LATERAL (SELECT
                CASE WHEN e.k = 0 THEN cur.attempt_count
                     WHEN e.attempt IS NOT NULL THEN e.attempt
                     WHEN e.k = 1 THEN cur.attempt_count::bigint + (cur.status <> 'pending')::int
                     ELSE cur.attempt_count END AS a_e,
                CASE cur.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END AS rank
            ) p,
            LATERAL (SELECT COALESCE(
                e.started_at,
                CASE WHEN e.k = 1 THEN e.now
                     WHEN p.a_e = cur.attempt_count AND cur.status = 'running' THEN cur.started_at
                END) AS started_at
            ) s
    )
            SELECT d.outcome, d.a_e, d.started_at AS judged_started_at, e.now,
                   cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count, cur.output::text AS output, cur.external_output_url, cur.started_at, cur.completed_at, cur.error_code, cur.error_message, cur.created_at, cur.updated_at, cur.lease_expires_at
            INTO judged
            FROM dec d JOIN cur ON cur.i = d.i JOIN e ON e.i = d.i;
            IF NOT FOUND THEN
                RETURN QUERY 
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at, x.completed_at,
               x.output::jsonb AS output, x.url, x.error_code, x.error_message, x.ordinal,
               clock_timestamp() + x.lease_seconds * interval '1 second' AS lease_expires_at,
               clock_timestamp() AS now,
               CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
               CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                           WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
            AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
                 error_code, error_message, ordinal, lease_seconds)
    ),
    known AS (
        SELECT p.id, p.instance_key FROM process_instance p
        WHERE p.instance_key IN (SELECT instance_key FROM e)
    ),
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN known ON known.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = known.id AND r.step_slug = e.step_slug
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    fresh AS (
        SELECT e.i, e.instance_key, e.ordinal,
               count(*) FILTER (WHERE e.ordinal IS NULL)
                   OVER (PARTITION BY e.instance_key ORDER BY e.i) AS s
        FROM e
        WHERE e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
    ),
    spans AS (
        SELECT f.*,
               max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key ORDER BY f.i) AS a,
               max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key) AS a_total,
               count(*) FILTER (WHERE f.ordinal IS NULL)
                   OVER (PARTITION BY f.instance_key) AS s_total
        FROM fresh f
    ),
    locked AS (
        SELECT p.id, p.instance_key, p.next_ordinal AS base FROM process_instance p
        WHERE p.instance_key IN (SELECT instance_key FROM spans)
        ORDER BY p.id
        FOR UPDATE
    ),
    assigned AS (
        SELECT sp.i, sp.instance_key, l.id AS locked_id,
               COALESCE(sp.ordinal, sp.s + GREATEST(COALESCE(l.base, 0), sp.a) - 1) AS ordinal,
               sp.s_total + GREATEST(COALESCE(l.base, 0), sp.a_total) AS next_ordinal
        FROM spans sp LEFT JOIN locked l ON l.instance_key = sp.instance_key
    ),
    bump AS (
        UPDATE process_instance p SET next_ordinal = x.next_ordinal
        FROM (SELECT DISTINCT locked_id, next_ordinal FROM assigned
              WHERE locked_id IS NOT NULL) x
        WHERE p.id = x.locked_id
        RETURNING p.id
    ),
    new_instance AS (
        INSERT INTO process_instance (instance_key, next_ordinal)
        SELECT a.instance_key, max(a.next_ordinal) FROM assigned a
        WHERE NOT EXISTS (SELECT 1 FROM known WHERE known.instance_key = a.instance_key)
        GROUP BY a.instance_key
        ORDER BY a.instance_key
        ON CONFLICT ON CONSTRAINT uq_process_instance_instance_key DO NOTHING
        RETURNING id, instance_key
    ),
    inst AS (
        SELECT id, instance_key FROM new_instance
        UNION ALL
        SELECT id, instance_key FROM known
    ),
    ins AS (
        INSERT INTO workflow_step_record AS r (
            instance_id, step_slug, ordinal, status, attempt_count, output, external_output_url,
            started_at, completed_at, error_code, error_message, lease_expires_at, created_at,
            updated_at)
        SELECT inst.id, e.step_slug, a.ordinal, e.target,
               CASE WHEN e.k = 0 THEN 1 ELSE COALESCE(e.attempt, 1) END,
               e.output, e.url,
               CASE WHEN e.k > 0 THEN COALESCE(e.started_at, e.now) END,
               CASE WHEN e.k = 2 THEN COALESCE(e.completed_at, GREATEST(e.now, e.started_at)) END,
               e.error_code, e.error_message, e.lease_expires_at, e.now, e.now
        FROM assigned a
        JOIN e ON e.i = a.i
        JOIN inst ON inst.instance_key = a.instance_key
        WHERE a.ordinal <= 2147483647
        ORDER BY inst.id, e.step_slug
        RETURNING r.*
    )
    SELECT e.i, 'created' AS outcome, ins.id, ins.step_slug, ins.ordinal, ins.status, ins.attempt_count, ins.output::text AS output, ins.external_output_url, ins.started_at, ins.completed_at, ins.error_code, ins.error_message, ins.created_at, ins.updated_at, ins.lease_expires_at
    FROM ins JOIN inst ON inst.id = ins.instance_id
    JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
    UNION ALL
    SELECT e.i, 'not_started', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM e
    WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
    UNION ALL
    SELECT a.i, 'ordinal_taken', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM assigned a WHERE a.ordinal > 2147483647
;
            ELSIF judged.outcome = 'applied' THEN
                RETURN QUERY 
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at, x.completed_at,
               x.output::jsonb AS output, x.url, x.error_code, x.error_message, x.ordinal,
               judged.now + x.lease_seconds * interval '1 second' AS lease_expires_at,
               judged.now AS now,
               CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
               CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                           WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
            AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
                 error_code, error_message, ordinal, lease_seconds)
    ),
                dec AS (
                    SELECT $1 AS i, judged.id AS id, judged.a_e AS a_e,
                           judged.judged_started_at AS started_at, 'applied'::text AS outcome
                ),
    upd AS (
        UPDATE workflow_step_record r SET
            status = e.target,
            attempt_count = d.a_e,
            started_at = d.started_at,
            completed_at = CASE WHEN e.k = 2
                                THEN COALESCE(e.completed_at, GREATEST(e.now, d.started_at)) END,
            output = e.output,
            external_output_url = e.url,
            error_code = e.error_code,
            error_message = e.error_message,
            lease_expires_at = e.lease_expires_at,
            updated_at = e.now
        FROM dec d JOIN e ON e.i = d.i
        WHERE r.id = d.id AND d.outcome = 'applied'
        RETURNING d.i, r.*
    )
                SELECT upd.i, 'applied'::text, upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count, upd.output::text AS output, upd.external_output_url, upd.started_at, upd.completed_at, upd.error_code, upd.error_message, upd.created_at, upd.updated_at, upd.lease_expires_at FROM upd;
            ELSE
                RETURN QUERY SELECT $1, judged.outcome, judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count, judged.output::text AS output, judged.external_output_url, judged.started_at, judged.completed_at, judged.error_code, judged.error_message, judged.created_at, judged.updated_at, judged.lease_expires_at;
            END IF;
        END

        $function$;

CREATE OR REPLACE FUNCTION public.steprecord_apply_events(integer[], text[], text[], text[], bigint[], timestamp with time zone[], timestamp with time zone[], text[], text[], text[], text[], bigint[], integer[])
 RETURNS TABLE(i integer, outcome text, id bigint, step_slug text, ordinal integer, status text, attempt_count integer, output text, external_output_url text, started_at timestamp with time zone, completed_at timestamp with time zone, error_code text, error_message text, created_at timestamp with time zone, updated_at timestamp with time zone, lease_expires_at timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
        #variable_conflict use_column
        BEGIN
            RETURN QUERY 
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at, x.completed_at,
               x.output::jsonb AS output, x.url, x.error_code, x.error_message, x.ordinal,
               clock_timestamp() + x.lease_seconds * interval '1 second' AS lease_expires_at,
               clock_timestamp() AS now,
               CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
               CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                           WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM unnest(
            $1::int[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::timestamptz[],
            $7::timestamptz[], $8::text[], $9::text[], $10::text[], $11::text[], $12::bigint[],
            $13::int[]
        ) AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
               error_code, error_message, ordinal, lease_seconds)
    ),
    known AS (
        SELECT p.id, p.instance_key FROM process_instance p
        WHERE p.instance_key IN (SELECT instance_key FROM e)
    ),
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN known ON known.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = known.id AND r.step_slug = e.step_slug
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    dec AS (
        SELECT cur.i, cur.id, p.a_e, s.started_at, e.target, e.k, e.completed_at, e.now,
               e.output, e.url, e.error_code, e.error_message, e.lease_expires_at,
            CASE
                WHEN (p.a_e, e.k) > (cur.attempt_count, p.rank) THEN
                    CASE WHEN p.a_e > 2147483647 THEN 'conflict'
                         WHEN e.k = 2 AND s.started_at IS NULL THEN 'not_started'
                         ELSE 'applied' END
                WHEN (p.a_e, e.k) = (cur.attempt_count, p.rank) THEN
                    CASE WHEN e.k < 2 THEN 'replay'
                         WHEN cur.status = e.target
                              AND cur.output IS NOT DISTINCT FROM e.output
                              AND cur.external_output_url IS NOT DISTINCT FROM e.url
                              AND cur.error_code IS NOT DISTINCT FROM e.error_code
                              AND cur.error_message IS NOT DISTINCT FROM e.error_message
                         THEN 'replay'
                         ELSE 'conflict' END
                WHEN p.a_e = cur.attempt_count THEN 'replay'
                ELSE 'stale_attempt'
            END AS outcome
        FROM cur JOIN e ON e.i = cur.i,
            LATERAL (SELECT
                CASE WHEN e.k = 0 THEN cur.attempt_count
                     WHEN e.attempt IS NOT NULL THEN e.attempt
                     WHEN e.k = 1 THEN cur.attempt_count::bigint + (cur.status <> 'pending')::int
                     ELSE cur.attempt_count END AS a_e,
                CASE cur.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END AS rank
            ) p,
            LATERAL (SELECT COALESCE(
                e.started_at,
                CASE WHEN e.k = 1 THEN e.now
                     WHEN p.a_e = cur.attempt_count AND cur.status = 'running' THEN cur.started_at
                END) AS started_at
            ) s
    ),
    upd AS (
        UPDATE workflow_step_record r SET
            status = d.target,
            attempt_count = d.a_e,
            started_at = d.started_at,
            completed_at = CASE WHEN d.k = 2
                                THEN COALESCE(d.completed_at, GREATEST(d.now, d.started_at)) END,
            output = d.output,
            external_output_url = d.url,
            error_code = d.error_code,
            error_message = d.error_message,
            lease_expires_at = d.lease_expires_at,
            updated_at = d.now
        FROM dec d
        WHERE r.id = d.id AND d.outcome = 'applied'
        RETURNING d.i, r.*
    ),
    fresh AS (
        SELECT e.i, e.instance_key, e.ordinal,
               count(*) FILTER (WHERE e.ordinal IS NULL)
                   OVER (PARTITION BY e.instance_key ORDER BY e.i) AS s
        FROM e
        WHERE e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
    ),
    spans AS (
        SELECT f.*,
               max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key ORDER BY f.i) AS a,
               max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key) AS a_total,
               count(*) FILTER (WHERE f.ordinal IS NULL)
                   OVER (PARTITION BY f.instance_key) AS s_total
        FROM fresh f
    ),
    locked AS (
        SELECT p.id, p.instance_key, p.next_ordinal AS base FROM process_instance p
        WHERE p.instance_key IN (SELECT instance_key FROM spans)
        ORDER BY p.id
        FOR UPDATE
    ),
    assigned AS (
        SELECT sp.i, sp.instance_key, l.id AS locked_id,
               COALESCE(sp.ordinal, sp.s + GREATEST(COALESCE(l.base, 0), sp.a) - 1) AS ordinal,
               sp.s_total + GREATEST(COALESCE(l.base, 0), sp.a_total) AS next_ordinal
        FROM spans sp LEFT JOIN locked l ON l.instance_key = sp.instance_key
    ),
    bump AS (
        UPDATE process_instance p SET next_ordinal = x.next_ordinal
        FROM (SELECT DISTINCT locked_id, next_ordinal FROM assigned
              WHERE locked_id IS NOT NULL) x
        WHERE p.id = x.locked_id
        RETURNING p.id
    ),
    new_instance AS (
        INSERT INTO process_instance (instance_key, next_ordinal)
        SELECT a.instance_key, max(a.next_ordinal) FROM assigned a
        WHERE NOT EXISTS (SELECT 1 FROM known WHERE known.instance_key = a.instance_key)
        GROUP BY a.instance_key
        ORDER BY a.instance_key
        ON CONFLICT ON CONSTRAINT uq_process_instance_instance_key DO NOTHING
        RETURNING id, instance_key
    ),
    inst AS (
        SELECT id, instance_key FROM new_instance
        UNION ALL
        SELECT id, instance_key FROM known
    ),
    ins AS (
        INSERT INTO workflow_step_record AS r (
            instance_id, step_slug, ordinal, status, attempt_count, output, external_output_url,
            started_at, completed_at, error_code, error_message, lease_expires_at, created_at,
            updated_at)
        SELECT inst.id, e.step_slug, a.ordinal, e.target,
               CASE WHEN e.k = 0 THEN 1 ELSE COALESCE(e.attempt, 1) END,
               e.output, e.url,
               CASE WHEN e.k > 0 THEN COALESCE(e.started_at, e.now) END,
               CASE WHEN e.k = 2 THEN COALESCE(e.completed_at, GREATEST(e.now, e.started_at)) END,
               e.error_code, e.error_message, e.lease_expires_at, e.now, e.now
        FROM assigned a
        JOIN e ON e.i = a.i
        JOIN inst ON inst.instance_key = a.instance_key
        WHERE a.ordinal <= 2147483647
        ORDER BY inst.id, e.step_slug
        RETURNING r.*
    )
    SELECT e.i, 'created' AS outcome, ins.id, ins.step_slug, ins.ordinal, ins.status, ins.attempt_count, ins.output::text AS output, ins.external_output_url, ins.started_at, ins.completed_at, ins.error_code, ins.error_message, ins.created_at, ins.updated_at, ins.lease_expires_at
    FROM ins JOIN inst ON inst.id = ins.instance_id
    JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
    UNION ALL
    SELECT upd.i, 'applied', upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count, upd.output::text AS output, upd.external_output_url, upd.started_at, upd.completed_at, upd.error_code, upd.error_message, upd.created_at, upd.updated_at, upd.lease_expires_at FROM upd
    UNION ALL
    SELECT d.i, d.outcome, cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count, cur.output::text AS output, cur.external_output_url, cur.started_at, cur.completed_at, cur.error_code, cur.error_message, cur.created_at, cur.updated_at, cur.lease_expires_at FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM e
    WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
    UNION ALL
    SELECT a.i, 'ordinal_taken', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM assigned a WHERE a.ordinal > 2147483647
;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.steprecord_heartbeat(integer[], text[], text[], bigint[], integer[])
 RETURNS TABLE(i integer, outcome text, id bigint, step_slug text, ordinal integer, status text, attempt_count integer, output text, external_output_url text, started_at timestamp with time zone, completed_at timestamp with time zone, error_code text, error_message text, created_at timestamp with time zone, updated_at timestamp with time zone, lease_expires_at timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
        #variable_conflict use_column
        BEGIN
            RETURN QUERY 
    WITH e AS MATERIALIZED (
        SELECT x.*, clock_timestamp() AS now
        FROM unnest($1::int[], $2::text[], $3::text[], $4::bigint[], $5::int[])
            AS x(i, instance_key, step_slug, attempt, lease_seconds)
    ),
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN process_instance p ON p.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = e.step_slug
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    dec AS (
        SELECT cur.i, cur.id,
            CASE WHEN e.attempt < cur.attempt_count THEN 'stale_attempt'
                 WHEN cur.status = 'pending' THEN 'not_started'
                 WHEN e.attempt > cur.attempt_count OR cur.status <> 'running' THEN 'not_running'
                 ELSE 'applied' END AS outcome
        FROM cur JOIN e ON e.i = cur.i
    ),
    upd AS (
        UPDATE workflow_step_record r SET
            lease_expires_at = e.now + e.lease_seconds * interval '1 second',
            updated_at = e.now
        FROM dec d JOIN e ON e.i = d.i
        WHERE r.id = d.id AND d.outcome = 'applied'
        RETURNING d.i, r.*
    )
    SELECT upd.i, 'applied' AS outcome, upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count, upd.output::text AS output, upd.external_output_url, upd.started_at, upd.completed_at, upd.error_code, upd.error_message, upd.created_at, upd.updated_at, upd.lease_expires_at FROM upd
    UNION ALL
    SELECT d.i, d.outcome, cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count, cur.output::text AS output, cur.external_output_url, cur.started_at, cur.completed_at, cur.error_code, cur.error_message, cur.created_at, cur.updated_at, cur.lease_expires_at FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM e
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.steprecord_list_page(p_instance_key text, p_order text, p_after_ordinal integer, p_after_started_at timestamp with time zone, p_after_id bigint, p_statuses text[], p_max_rows integer)
 RETURNS TABLE(id bigint, instance_key text, step_slug text, ordinal integer, status text, attempt_count integer, output text, external_output_url text, started_at timestamp with time zone, completed_at timestamp with time zone, lease_expires_at timestamp with time zone, error_code text, error_message text, created_at timestamp with time zone, updated_at timestamp with time zone)
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
        $function$;

CREATE OR REPLACE FUNCTION public.steprecord_list_steps(p_instance_key text, p_order text, p_after_ordinal integer, p_after_started_at timestamp with time zone, p_after_id bigint, p_statuses text[], p_page_size integer, p_summary boolean)
 RETURNS TABLE(found bigint, items text, last_ordinal integer, last_started_at timestamp with time zone, last_id bigint)
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
        $function$;

CREATE OR REPLACE FUNCTION public.workflow_step_attempt_guard()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        DECLARE
            why text;
        BEGIN
            IF pg_trigger_depth() < 2 THEN
                why := 'the history is written only through workflow_step_record';
            ELSIF TG_OP = 'UPDATE' AND OLD.status <> 'running' THEN
                why := 'a finished or superseded attempt never changes';
            ELSIF TG_OP = 'UPDATE'
                  AND (NEW.id, NEW.instance_id, NEW.record_id, NEW.attempt, NEW.created_at)
                      IS DISTINCT FROM
                      (OLD.id, OLD.instance_id, OLD.record_id, OLD.attempt, OLD.created_at) THEN
                why := 'id, instance_id, record_id, attempt and created_at never change';
            END IF;
            IF why IS NOT NULL THEN
                RAISE EXCEPTION 'workflow_step_attempt: %', why
                    USING ERRCODE = 'check_violation',
                          CONSTRAINT = 'tr_workflow_step_attempt_guard',
                          TABLE = 'workflow_step_attempt';
            END IF;
            RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.workflow_step_record_guard_transition()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        DECLARE
            old_rank int := CASE OLD.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END;
            new_rank int := CASE NEW.status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END;
            why text;
        BEGIN
            IF (NEW.id, NEW.instance_id, NEW.step_slug, NEW.ordinal, NEW.created_at)
               IS DISTINCT FROM
               (OLD.id, OLD.instance_id, OLD.step_slug, OLD.ordinal, OLD.created_at) THEN
                why := 'id, instance_id, step_slug, ordinal and created_at never change';
            ELSIF (NEW.attempt_count, new_rank) < (OLD.attempt_count, old_rank) THEN
                why := format('(attempt_count, rank) may not go back from (%s, %s) to (%s, %s)',
                              OLD.attempt_count, old_rank, NEW.attempt_count, new_rank);
            ELSIF old_rank = 2 AND NEW.attempt_count = OLD.attempt_count
                  AND (NEW.status, NEW.started_at, NEW.completed_at, NEW.output,
                       NEW.external_output_url, NEW.error_code, NEW.error_message)
                      IS DISTINCT FROM
                      (OLD.status, OLD.started_at, OLD.completed_at, OLD.output,
                       OLD.external_output_url, OLD.error_code, OLD.error_message) THEN
                why := 'a finished attempt never changes; only a higher attempt reopens it';
            END IF;
            IF why IS NOT NULL THEN
                RAISE EXCEPTION 'workflow_step_record %: %', OLD.id, why
                    USING ERRCODE = 'check_violation',
                          CONSTRAINT = 'tr_workflow_step_record_transition',
                          TABLE = 'workflow_step_record';
            END IF;
            RETURN NEW;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.workflow_step_record_history_insert()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        BEGIN
            
            INSERT INTO workflow_step_attempt AS a (
                instance_id, record_id, attempt, status, started_at, completed_at, output, external_output_url, error_code, error_message, lease_expires_at,
                created_at, updated_at)
            SELECT n.instance_id, n.id, n.attempt_count, n.status, n.started_at,
                   n.completed_at, n.output, n.external_output_url, n.error_code,
                   n.error_message, n.lease_expires_at, n.updated_at, n.updated_at
            FROM new_rows n
            WHERE n.status <> 'pending'
            ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_record_id_attempt DO UPDATE SET
                status = EXCLUDED.status,
                started_at = EXCLUDED.started_at,
                completed_at = EXCLUDED.completed_at,
                output = EXCLUDED.output,
                external_output_url = EXCLUDED.external_output_url,
                error_code = EXCLUDED.error_code,
                error_message = EXCLUDED.error_message,
                lease_expires_at = CASE WHEN EXCLUDED.status = 'running' THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END,
                updated_at = EXCLUDED.updated_at
            WHERE (a.status, a.started_at, a.completed_at, a.output, a.external_output_url, a.error_code, a.error_message, a.lease_expires_at)
                  IS DISTINCT FROM
                  (EXCLUDED.status, EXCLUDED.started_at, EXCLUDED.completed_at, EXCLUDED.output, EXCLUDED.external_output_url, EXCLUDED.error_code, EXCLUDED.error_message,
                   CASE WHEN EXCLUDED.status = 'running' THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END);
    
            RETURN NULL;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.workflow_step_record_history_update()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        BEGIN
            UPDATE workflow_step_attempt a SET
                status = 'superseded',
                completed_at = GREATEST(a.started_at, COALESCE(n.started_at, n.updated_at)),
                updated_at = n.updated_at
            FROM old_rows o JOIN new_rows n ON n.id = o.id
            WHERE o.status = 'running' AND n.attempt_count > o.attempt_count
              AND a.record_id = o.id AND a.attempt = o.attempt_count AND a.status = 'running';
            
            INSERT INTO workflow_step_attempt AS a (
                instance_id, record_id, attempt, status, started_at, completed_at, output, external_output_url, error_code, error_message, lease_expires_at,
                created_at, updated_at)
            SELECT n.instance_id, n.id, n.attempt_count, n.status, n.started_at,
                   n.completed_at, n.output, n.external_output_url, n.error_code,
                   n.error_message, n.lease_expires_at, n.updated_at, n.updated_at
            FROM new_rows n
            WHERE n.status <> 'pending'
            ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_record_id_attempt DO UPDATE SET
                status = EXCLUDED.status,
                started_at = EXCLUDED.started_at,
                completed_at = EXCLUDED.completed_at,
                output = EXCLUDED.output,
                external_output_url = EXCLUDED.external_output_url,
                error_code = EXCLUDED.error_code,
                error_message = EXCLUDED.error_message,
                lease_expires_at = CASE WHEN EXCLUDED.status = 'running' THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END,
                updated_at = EXCLUDED.updated_at
            WHERE (a.status, a.started_at, a.completed_at, a.output, a.external_output_url, a.error_code, a.error_message, a.lease_expires_at)
                  IS DISTINCT FROM
                  (EXCLUDED.status, EXCLUDED.started_at, EXCLUDED.completed_at, EXCLUDED.output, EXCLUDED.external_output_url, EXCLUDED.error_code, EXCLUDED.error_message,
                   CASE WHEN EXCLUDED.status = 'running' THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END);
    
            RETURN NULL;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.workflow_step_record_notify()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        BEGIN
            PERFORM pg_notify('steprecord_changes', w.instance_id::text)
            FROM (SELECT DISTINCT instance_id FROM new_rows) w;
            RETURN NULL;
        END
        $function$;

CREATE OR REPLACE FUNCTION public.workflow_step_record_set_changed_xid()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        BEGIN
            NEW.changed_xid := pg_current_xact_id();
            RETURN NEW;
        END
        $function$;
