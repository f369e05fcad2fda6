-- steprecord_apply_event: the judge of one event (every POST .../declare, /start,
-- /complete, /fail), in at most two statements.
--
-- Arguments: the fields of steprecord_apply_events (apply_events.sql) as scalars, in the
-- same order: $1 i, $2 instance_key, $3 step_slug, $4 kind, $5 attempt, $6 started_at,
-- $7 completed_at, $8 output (JSON text), $9 external_output_url, $10 error_code,
-- $11 error_message, $12 ordinal, $13 lease_seconds; then p_trace_id (default NULL), the
-- request's trace id, which the attempt this event starts keeps (as in apply_events.sql).
--
-- Answer: the same row that steprecord_apply_events answers for a one-event call, judged
-- by the same rules (the judge's test calls both with every kind of event and compares
-- their answers). Where that statement does everything any event may need (judge, update,
-- count ordinals, lock, create and bump instances, insert), one event needs one half:
--   1. find the record and lock it, and judge the event (the general statement's `known`,
--      `cur` and `dec`);
--   2. when it applies, write it (`upd`); any other outcome writes nothing, so an unchanged
--      record fires no update trigger;
--   3. when there is no record, create it (the general statement without `dec` and `upd`),
--      or answer not_started or ordinal_taken;
--   4. when it is a late complete/fail of an older attempt, let the history take it (the
--      general statement's `late` steps). A record created concurrently between 1 and
--      3 is found there by `cur` and left alone: the event then has no answer row, as when
--      it loses such a race in the general statement, and the caller calls again.
-- The record's row lock taken in 1 is held until the transaction ends, so the decision of
-- 1 still holds when 2 or 4 writes.
CREATE OR REPLACE FUNCTION steprecord_apply_event(
    int, text, text, text, bigint, timestamptz, timestamptz, text, text, text, text, bigint, int,
    p_trace_id text DEFAULT NULL
) RETURNS TABLE (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    error_code text, error_message text, created_at timestamptz, updated_at timestamptz,
    lease_expires_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET steprecord.writer = 'judge'
SET steprecord.trace_id = ''
AS $fn$
#variable_conflict use_column
DECLARE
    judged record;
BEGIN
    -- The trace id for this call's writes only, set first and always (apply_events.sql says
    -- how the history's new attempt row takes it).
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);

    -- 1. The record, locked, and the event judged against it (see apply_events.sql for
    --    what each step decides). `judged` keeps the record as it stands and the clock.
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at,
               x.completed_at, x.output::jsonb AS output, x.url, x.error_code,
               x.error_message, x.ordinal,
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
           cur.instance_id AS judged_instance_id, cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count,
           cur.output::text AS output, cur.external_output_url, cur.started_at,
           cur.completed_at, cur.error_code, cur.error_message, cur.created_at,
           cur.updated_at, cur.lease_expires_at
    INTO judged
    FROM dec d JOIN cur ON cur.i = d.i JOIN e ON e.i = d.i;

    IF NOT FOUND THEN
        -- 3. No record: create it with its instance, as steprecord_apply_events does
        --    (apply_events.sql says why each step is there and in what order it locks).
        RETURN QUERY
        WITH e AS MATERIALIZED (
            SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at,
                   x.completed_at, x.output::jsonb AS output, x.url, x.error_code,
                   x.error_message, x.ordinal,
                   clock_timestamp() + x.lease_seconds * interval '1 second'
                       AS lease_expires_at,
                   clock_timestamp() AS now,
                   CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
                   CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                               WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
                   (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
            FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
                AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at,
                     output, url, error_code, error_message, ordinal, lease_seconds)
        ),
        known AS (
            SELECT p.id, p.instance_key FROM process_instance p
            WHERE p.instance_key IN (SELECT instance_key FROM e)
        ),
        -- A record created since step 1 is found (and locked) here, and the event below
        -- then creates nothing and answers nothing: the caller calls again.
        cur AS (
            SELECT e.i, r.* FROM e
            JOIN known ON known.instance_key = e.instance_key
            JOIN workflow_step_record r
                ON r.instance_id = known.id AND r.step_slug = e.step_slug
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
                   max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key ORDER BY f.i)
                       AS a,
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
                   COALESCE(sp.ordinal, sp.s + GREATEST(COALESCE(l.base, 0), sp.a) - 1)
                       AS ordinal,
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
                instance_id, step_slug, ordinal, status, attempt_count, output,
                external_output_url, started_at, completed_at, error_code, error_message,
                lease_expires_at, created_at, updated_at)
            SELECT inst.id, e.step_slug, a.ordinal, e.target,
                   CASE WHEN e.k = 0 THEN 1 ELSE COALESCE(e.attempt, 1) END,
                   e.output, e.url,
                   CASE WHEN e.k > 0 THEN COALESCE(e.started_at, e.now) END,
                   CASE WHEN e.k = 2
                        THEN COALESCE(e.completed_at, GREATEST(e.now, e.started_at)) END,
                   e.error_code, e.error_message, e.lease_expires_at, e.now, e.now
            FROM assigned a
            JOIN e ON e.i = a.i
            JOIN inst ON inst.instance_key = a.instance_key
            WHERE a.ordinal <= 2147483647
            ORDER BY inst.id, e.step_slug
            RETURNING r.*
        )
        SELECT e.i, 'created' AS outcome, false AS recorded,
               ins.id, ins.step_slug, ins.ordinal, ins.status, ins.attempt_count,
               ins.output::text AS output, ins.external_output_url, ins.started_at,
               ins.completed_at, ins.error_code, ins.error_message, ins.created_at,
               ins.updated_at, ins.lease_expires_at
        FROM ins JOIN inst ON inst.id = ins.instance_id
        JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
        UNION ALL
        SELECT e.i, 'not_started', false,
               NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
               NULL
        FROM e
        WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
        UNION ALL
        SELECT a.i, 'ordinal_taken', false,
               NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
               NULL
        FROM assigned a WHERE a.ordinal > 2147483647;
    ELSIF judged.outcome = 'applied' THEN
        -- 2. Applied: write the event over the locked record, at the clock of step 1. The
        --    new state replaces the whole record (a higher attempt starts afresh); a
        --    missing completed_at is the later of the clock and started_at.
        RETURN QUERY
        WITH e AS MATERIALIZED (
            SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at,
                   x.completed_at, x.output::jsonb AS output, x.url, x.error_code,
                   x.error_message, x.ordinal,
                   judged.now + x.lease_seconds * interval '1 second' AS lease_expires_at,
                   judged.now AS now,
                   CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
                   CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                               WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
                   (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
            FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
                AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at,
                     output, url, error_code, error_message, ordinal, lease_seconds)
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
                                    THEN COALESCE(e.completed_at, GREATEST(e.now, d.started_at))
                               END,
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
        SELECT upd.i, 'applied'::text, false,
               upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
               upd.output::text AS output, upd.external_output_url, upd.started_at,
               upd.completed_at, upd.error_code, upd.error_message, upd.created_at,
               upd.updated_at, upd.lease_expires_at
        FROM upd;
    ELSIF judged.outcome = 'stale_attempt' AND $4 IN ('complete', 'fail') THEN
        -- 4. A late report of an older attempt: the record stays as it is; the history takes
        --    the report when that attempt's entry is missing or superseded (see the `late`
        --    steps of apply_events.sql for the rules; these are the same over one event).
        RETURN QUERY
        WITH e AS MATERIALIZED (
            SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at,
                   x.completed_at, x.output::jsonb AS output, x.url, x.error_code,
                   x.error_message, x.ordinal,
                   judged.now + x.lease_seconds * interval '1 second' AS lease_expires_at,
                   judged.now AS now,
                   CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
                   CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                               WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
                   (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
            FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
                AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at,
                     output, url, error_code, error_message, ordinal, lease_seconds)
        ),
        late AS (
            SELECT e.i, judged.judged_instance_id AS instance_id, judged.id AS record_id,
                   judged.a_e AS attempt, e.target, e.now, e.output, e.url, e.error_code,
                   e.error_message, h.status AS entry_status, h.output AS entry_output,
                   h.external_output_url AS entry_url, h.error_code AS entry_error_code,
                   h.error_message AS entry_error_message, t.completed_at,
                   COALESCE(e.started_at, h.started_at, t.completed_at) AS started_at
            FROM e
            LEFT JOIN workflow_step_attempt h
                ON h.record_id = judged.id AND h.attempt = judged.a_e,
                LATERAL (SELECT COALESCE(
                    e.completed_at, GREATEST(e.now, COALESCE(e.started_at, h.started_at))
                ) AS completed_at) t
        ),
        late_write AS (
            INSERT INTO workflow_step_attempt AS a (
                instance_id, record_id, attempt, status, started_at, completed_at, output,
                external_output_url, error_code, error_message, created_at, updated_at)
            SELECT l.instance_id, l.record_id, l.attempt, l.target, l.started_at,
                   l.completed_at, l.output, l.url, l.error_code, l.error_message, l.now, l.now
            FROM late l
            WHERE (l.entry_status IS NULL OR l.entry_status = 'superseded')
              AND l.started_at <= l.completed_at
            ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_record_id_attempt DO UPDATE SET
                status = EXCLUDED.status,
                started_at = EXCLUDED.started_at,
                completed_at = EXCLUDED.completed_at,
                output = EXCLUDED.output,
                external_output_url = EXCLUDED.external_output_url,
                error_code = EXCLUDED.error_code,
                error_message = EXCLUDED.error_message,
                updated_at = EXCLUDED.updated_at
            WHERE a.status = 'superseded'
            RETURNING a.record_id, a.attempt
        )
        SELECT $1, judged.outcome,
            EXISTS (SELECT 1 FROM late_write)
            OR EXISTS (SELECT 1 FROM late l
                       WHERE l.entry_status = l.target
                         AND l.entry_output IS NOT DISTINCT FROM l.output
                         AND l.entry_url IS NOT DISTINCT FROM l.url
                         AND l.entry_error_code IS NOT DISTINCT FROM l.error_code
                         AND l.entry_error_message IS NOT DISTINCT FROM l.error_message),
            judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count,
            judged.output::text AS output, judged.external_output_url, judged.started_at,
            judged.completed_at, judged.error_code, judged.error_message, judged.created_at,
            judged.updated_at, judged.lease_expires_at;
    ELSE
        -- Judged without a write (a replay or a refusal): the record as it stands.
        RETURN QUERY SELECT $1, judged.outcome, false,
            judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count,
            judged.output::text AS output, judged.external_output_url, judged.started_at,
            judged.completed_at, judged.error_code, judged.error_message, judged.created_at,
            judged.updated_at, judged.lease_expires_at;
    END IF;
END
$fn$;
