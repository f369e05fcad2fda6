-- Revision 0023_judge_on_citus, downgrade: the same files as of revision 0022.
-- Made by `python -m app.sql freeze 0023_judge_on_citus`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- Functions this revision created or declared otherwise:
DROP FUNCTION steprecord_apply_events_on_shard(p_instance_id bigint, p_i int[], p_instance_key text[], p_step_slug text[], p_kind text[], p_attempt bigint[], p_started_at timestamptz[], p_completed_at timestamptz[], p_output text[], p_external_output_url text[], p_error_code text[], p_error_message text[], p_ordinal bigint[], p_lease_seconds int[], p_trace_id text);

-- ===== app/sql/apply_event.sql as of revision 0022 =====
-- steprecord_apply_event: the judge of one event (every POST .../declare, /start,
-- /complete, /fail), on the judge's own rules (judge_rules.sql) and, for everything but
-- the most common write, on steprecord_apply_events itself (apply_events.sql).
--
-- Arguments: p_instance_id, the instance's id (steprecord_instance_id(p_instance_key): the
-- service's statement computes it so), then the fields of steprecord_apply_events as
-- scalars, in the same order and with the same names (p_i, p_instance_key, ...
-- p_lease_seconds), then p_trace_id (default NULL): the request's trace id, which the
-- attempt this event starts keeps. On Citus p_instance_id is the function's distribution
-- argument: the coordinator sends the whole call to the worker that holds the instance.
-- An id that is not its key's finds no record, and the general statement (4) judges the
-- event by its key alone.
--
-- Answer: the row a one-element call of steprecord_apply_events answers. The general
-- statement holds every step any event may need, and its plan costs more to run than one
-- event on an existing record needs; so:
--   1. find the record, lock it, and judge the event (judge_outcome);
--   2. when the record exists and the event writes nothing (a replay or a refusal), answer
--      the record as it stands;
--   3. when the event applies to the record, write it: the update of the general
--      statement's `upd`, each value from the same rule;
--   4. otherwise (no record yet, or a late complete/fail of an older attempt, which the
--      history may take), call steprecord_apply_events with the event.
-- The record's row lock taken in 1 is held until the transaction ends, so the judgement of 1
-- still holds when 3 writes, and 4 judges the record 1 judged as 1 did.
--
-- steprecord.trace_id = '', restored when the call returns, and set first (as in
-- apply_events.sql): the attempt an update of 3 starts keeps this call's trace id.
CREATE OR REPLACE FUNCTION steprecord_apply_event(
    p_instance_id bigint, p_i int, p_instance_key text, p_step_slug text, p_kind text, p_attempt bigint,
    p_started_at timestamptz, p_completed_at timestamptz, p_output text,
    p_external_output_url text, p_error_code text, p_error_message text, p_ordinal bigint,
    p_lease_seconds int, p_trace_id text DEFAULT NULL
) RETURNS TABLE (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value: Citus runs only IMMUTABLE functions inside a write
    -- of a distributed table, so the statements below never call a clock.
    v_now timestamptz := clock_timestamp();
    judged record;
BEGIN
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);

    -- 1. The record, locked, and the event judged against its newest version, with the
    --    attempt and start time an update writes.
    SELECT judge_outcome(p_kind, p_attempt, p_started_at, v_now, p_output::jsonb,
                                p_external_output_url, p_error_code, p_error_message,
                                r.attempt_count, r.status, r.started_at, r.output,
                                r.external_output_url, r.error_code, r.error_message)
               AS outcome,
           judge_event_attempt(p_kind, p_attempt, r.attempt_count, r.status)
               AS new_attempt,
           judge_event_started_at(p_kind, p_attempt, p_started_at, v_now,
                                       r.attempt_count, r.status, r.started_at)
               AS new_started_at,
           r.id, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output::text AS output,
           r.external_output_url, r.started_at, r.completed_at, r.error_code, r.error_message,
           r.created_at, r.updated_at, r.lease_expires_at
    INTO judged
    FROM process_instance p
    JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = p_step_slug
    WHERE p.id = p_instance_id AND p.instance_key = p_instance_key
    FOR UPDATE OF r;

    IF NOT FOUND OR (judged.outcome = 'stale_attempt' AND p_kind IN ('complete', 'fail')) THEN
        -- 4. The event as a one-element call of the general statement.
        RETURN QUERY SELECT * FROM steprecord_apply_events(
            ARRAY[p_i], ARRAY[p_instance_key], ARRAY[p_step_slug], ARRAY[p_kind],
            ARRAY[p_attempt], ARRAY[p_started_at], ARRAY[p_completed_at], ARRAY[p_output],
            ARRAY[p_external_output_url], ARRAY[p_error_code], ARRAY[p_error_message],
            ARRAY[p_ordinal], ARRAY[p_lease_seconds], p_trace_id);
    ELSIF judged.outcome = 'applied' THEN
        -- 3. Applied: the event replaces the record's whole state, as `upd` does.
        RETURN QUERY
        WITH upd AS (
            UPDATE workflow_step_record r SET
                status = judge_event_status(p_kind),
                attempt_count = judged.new_attempt,
                started_at = judged.new_started_at,
                completed_at = judge_event_completed_at(p_kind, p_completed_at, v_now,
                                                             judged.new_started_at),
                output = p_output::jsonb,
                external_output_url = p_external_output_url,
                error_code = p_error_code,
                error_message = p_error_message,
                lease_expires_at = judge_lease_expires_at(v_now, p_lease_seconds),
                updated_at = v_now
            WHERE r.instance_id = p_instance_id AND r.id = judged.id
            RETURNING r.*
        )
        SELECT p_i, 'applied'::text, false,
               upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
               upd.output::text AS output, upd.external_output_url, upd.started_at,
               upd.completed_at, upd.lease_expires_at, upd.error_code,
               upd.error_message, upd.created_at, upd.updated_at
        FROM upd;
    ELSE
        -- 2. Judged without a write: the record as it stands.
        RETURN QUERY SELECT p_i, judged.outcome, false,
            judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count,
            judged.output, judged.external_output_url, judged.started_at,
            judged.completed_at, judged.lease_expires_at, judged.error_code,
            judged.error_message, judged.created_at, judged.updated_at;
    END IF;
END
$fn$;


-- ===== app/sql/apply_events.sql as of revision 0022 =====
-- steprecord_apply_events: the judge of a set of events, in one statement.
--
-- Arguments, one array per field, all of the same length (element n is event n):
--   p_i (the event's index in the caller's list), p_instance_key, p_step_slug,
--   p_kind ('declare' | 'start' | 'complete' | 'fail'), p_attempt, p_started_at,
--   p_completed_at, p_output (JSON text), p_external_output_url, p_error_code,
--   p_error_message, p_ordinal, p_lease_seconds. NULL means "not sent".
-- Then one scalar, p_trace_id (default NULL): the W3C trace id (32 lowercase hex digits) of
-- the request that sent the events, or NULL when it had none. An attempt that an event
-- starts keeps it (workflow_step_attempt.trace_id; see the first step below).
--
-- The events must be of distinct steps: each is judged as if alone (the caller splits a
-- list where a step repeats, so later events of a step see the earlier ones' effects).
--
-- Answer: one row per event, its index `i`, the `outcome`, whether a late report was
-- `recorded` in the history (below), and the record after the event (or as it stands, when
-- the event was refused; NULLs when there is none), its columns as app/record.py lists them:
--   created        the event made the record;
--   applied        the event was newer than the record and is now the record;
--   replay         the same position and content as recorded, or a late start/declare of
--                  the record's own attempt: nothing written;
--   conflict       the same position with other content, or no attempt left: nothing written;
--   stale_attempt  an event of an attempt older than the record's: the record is not
--                  written. A complete/fail of such an attempt is still true news about it
--                  (a late report): when that attempt's history entry is missing or
--                  `superseded`, the report becomes the entry, and `recorded` is true; it is
--                  true as well when the entry already holds this very report (a duplicate).
--                  A terminal entry never changes.
--   not_started    a complete/fail with no start to complete: nothing written;
--   instance_key_collision  the instance's id (steprecord_instance_id of its key) belongs to
--                  the instance of another key: nothing written, never merged;
--   ordinal_taken  no server-assigned ordinal is left (past 2147483647): nothing written.
-- An event with no answer row lost a race with a concurrent creator of its instance (this
-- statement's snapshot cannot see the new instance row): the caller calls again with it,
-- and the next snapshot sees it. A constraint the database refuses (a bad value, a unique
-- key taken by a concurrent creator of the same step, a deadlock) aborts the statement:
-- nothing of it was written.
--
-- The rules (positions, the judgement, the times, the lease, what a report is) are the
-- functions of judge_rules.sql, which steprecord_apply_event calls as well; this statement
-- says which records they are applied to and what is written.
--
-- plan_cache_mode = force_generic_plan: every access is by key, so the plan does not depend
-- on the arrays' contents; one generic plan, made once per connection, serves every call
-- (a custom plan would be made again, at the full planning cost, on every call).
-- steprecord.writer = 'judge', for the call only: the history's guard lets the judge, and
-- nothing else, write a late report into the history (attempt_history.sql).
-- steprecord.trace_id = '', restored when the call returns: the trace id set below holds
-- for this call's writes only, never for later statements of the same transaction.
CREATE OR REPLACE FUNCTION steprecord_apply_events(
    p_i int[], p_instance_key text[], p_step_slug text[], p_kind text[], p_attempt bigint[],
    p_started_at timestamptz[], p_completed_at timestamptz[], p_output text[],
    p_external_output_url text[], p_error_code text[], p_error_message text[],
    p_ordinal bigint[], p_lease_seconds int[], p_trace_id text DEFAULT NULL
) RETURNS TABLE (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- One clock reading per call, a value (clock_timestamp, not now(): a retried call in the
    -- same transaction reads anew). The statement below uses it, never a clock call: Citus
    -- runs only IMMUTABLE functions inside a write of a distributed table.
    v_now timestamptz := clock_timestamp();
BEGIN
    PERFORM set_config('steprecord.writer', 'judge', true);
    -- The trace id of this call, set first and always (an empty string for none), so that a
    -- value never carries over from an earlier call of the same transaction. The history's
    -- rows are written by the record's triggers (attempt_history.sql), which do not name
    -- trace_id: a new attempt row takes the column's default,
    -- nullif(current_setting('steprecord.trace_id', true), ''), so an attempt keeps the
    -- trace of the event that started it, and later writes of its row never change it.
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);

    RETURN QUERY
    -- e: the events, with what every later step needs of them: the instance's id, derived
    -- from its key (instance_id.sql), and the call's clock reading. Only a declare, a start, or a complete/fail that brings its own started_at may create
    -- a record: a record never exists without its start time.
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, steprecord_instance_id(x.instance_key) AS instance_id,
               x.step_slug, x.kind, x.attempt, x.started_at,
               x.completed_at, x.output::jsonb AS output, x.url, x.error_code,
               x.error_message, x.ordinal,
               judge_lease_expires_at(v_now, x.lease_seconds) AS lease_expires_at,
               v_now AS now,
               judge_event_status(x.kind) AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM unnest(
            p_i, p_instance_key, p_step_slug, p_kind, p_attempt, p_started_at, p_completed_at,
            p_output, p_external_output_url, p_error_code, p_error_message, p_ordinal,
            p_lease_seconds
        ) AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
               error_code, error_message, ordinal, lease_seconds)
    ),
    -- held: the instances that hold the events' ids (as this statement's snapshot sees
    -- them); known: those of the events' own keys. An id held by another key's instance is
    -- a collision: its events are answered so, and write nothing.
    held AS (
        SELECT p.id, p.instance_key FROM process_instance p
        WHERE p.id IN (SELECT instance_id FROM e)
    ),
    known AS (
        SELECT held.id, held.instance_key FROM held
        WHERE held.instance_key IN (SELECT instance_key FROM e)
    ),
    collided AS (
        SELECT e.i FROM e JOIN held ON held.id = e.instance_id
        WHERE held.instance_key <> e.instance_key
    ),
    -- cur: the existing records, locked in id order, so two calls that lock the same
    -- records wait for each other instead of deadlocking. Every decision below is made on
    -- the locked, newest version of the row: no merge decision uses data read outside it.
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN known ON known.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = known.id AND r.step_slug = e.step_slug
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    -- dec: the judgement of each event whose record exists (judge_outcome), with
    -- the values an update writes: the event's attempt and start time (so `upd` reads `dec`
    -- alone, one lookup per record, whatever the call's size).
    dec AS (
        SELECT cur.i, cur.instance_id, cur.id, e.target, e.kind, e.completed_at, e.now, e.output, e.url,
               e.error_code, e.error_message, e.lease_expires_at,
               judge_event_attempt(e.kind, e.attempt, cur.attempt_count, cur.status)
                   AS attempt,
               judge_event_started_at(e.kind, e.attempt, e.started_at, e.now,
                                           cur.attempt_count, cur.status, cur.started_at)
                   AS started_at,
               judge_outcome(e.kind, e.attempt, e.started_at, e.now, e.output, e.url,
                                    e.error_code, e.error_message, cur.attempt_count,
                                    cur.status, cur.started_at, cur.output,
                                    cur.external_output_url, cur.error_code,
                                    cur.error_message) AS outcome
        FROM cur JOIN e ON e.i = cur.i
    ),
    -- upd: write what was applied, and nothing else (a replay or a refusal leaves
    -- updated_at as it was). The event replaces the whole state: a higher attempt starts
    -- afresh, so the previous attempt's times, output, error and lease are cleared. The
    -- record's triggers keep the history and notify the stream in the same statement.
    upd AS (
        UPDATE workflow_step_record r SET
            status = d.target,
            attempt_count = d.attempt,
            started_at = d.started_at,
            completed_at = judge_event_completed_at(d.kind, d.completed_at, d.now,
                                                         d.started_at),
            output = d.output,
            external_output_url = d.url,
            error_code = d.error_code,
            error_message = d.error_message,
            lease_expires_at = d.lease_expires_at,
            updated_at = d.now
        FROM dec d
        WHERE r.instance_id = d.instance_id AND r.id = d.id AND d.outcome = 'applied'
        RETURNING d.i, r.*
    ),
    -- late: the complete/fail reports of an attempt older than the record's (stale), with
    -- that attempt's history entry (h), under the record's row lock taken in `cur`, so no
    -- other writer of this record's history runs meanwhile. The report's times: its own
    -- completed_at, else the later of the clock and the start known; its own started_at,
    -- else the entry's, else (nothing known) its completed_at.
    late AS (
        SELECT d.i, cur.instance_id, cur.id AS record_id, d.attempt, e.target, e.now,
               e.output, e.url, e.error_code, e.error_message, h.status AS entry_status,
               h.output AS entry_output, h.external_output_url AS entry_url,
               h.error_code AS entry_error_code, h.error_message AS entry_error_message,
               t.completed_at, COALESCE(e.started_at, h.started_at, t.completed_at) AS started_at
        FROM dec d JOIN cur ON cur.i = d.i JOIN e ON e.i = d.i
        LEFT JOIN workflow_step_attempt h
            ON h.instance_id = cur.instance_id AND h.record_id = cur.id
           AND h.attempt = d.attempt,
            LATERAL (SELECT judge_event_completed_at(
                e.kind, e.completed_at, e.now, COALESCE(e.started_at, h.started_at)
            ) AS completed_at) t
        WHERE d.outcome = 'stale_attempt' AND e.kind IN ('complete', 'fail')
    ),
    -- late_write: a missing entry is inserted, a superseded one becomes the report; a
    -- terminal entry is left as it is (the WHERE of the upsert), and a report whose start
    -- would follow its end writes nothing. An inserted entry takes this call's trace id
    -- (the report is the first the history hears of that attempt); an updated one keeps its own.
    late_write AS (
        INSERT INTO workflow_step_attempt AS a (
            instance_id, record_id, attempt, status, started_at, completed_at, output,
            external_output_url, error_code, error_message, created_at, updated_at)
        SELECT l.instance_id, l.record_id, l.attempt, l.target, l.started_at, l.completed_at,
               l.output, l.url, l.error_code, l.error_message, l.now, l.now
        FROM late l
        WHERE (l.entry_status IS NULL OR l.entry_status = 'superseded')
          AND l.started_at <= l.completed_at
        ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
        DO UPDATE SET
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
    ),
    -- late_recorded: the report is in the history now, written here or there already (the
    -- same status and content: a duplicate of a late report is recorded as the first was).
    late_recorded AS (
        SELECT l.i FROM late l
        WHERE EXISTS (SELECT 1 FROM late_write w
                      WHERE w.record_id = l.record_id AND w.attempt = l.attempt)
           OR judge_same_report(l.entry_status, l.entry_output, l.entry_url,
                                     l.entry_error_code, l.entry_error_message,
                                     l.target, l.output, l.url, l.error_code, l.error_message)
    ),
    -- fresh: the events that create a record. s counts, per instance and in event order,
    -- the new steps whose ordinal the server assigns.
    fresh AS (
        SELECT e.i, e.instance_key, e.instance_id, e.ordinal,
               count(*) FILTER (WHERE e.ordinal IS NULL)
                   OVER (PARTITION BY e.instance_key ORDER BY e.i) AS s
        FROM e
        WHERE e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
          AND NOT EXISTS (SELECT 1 FROM collided c WHERE c.i = e.i)
    ),
    -- spans: server-assigned ordinals follow event order, as if the events were applied one
    -- by one. With s the running count of server-assigned steps and a the running max of
    -- (client ordinal + 1 - s), a server-assigned step gets s + max(base, a) - 1, and the
    -- instance's counter ends at s_total + max(base, a_total).
    spans AS (
        SELECT f.*,
               max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key ORDER BY f.i) AS a,
               max(f.ordinal + 1 - f.s) OVER (PARTITION BY f.instance_key) AS a_total,
               count(*) FILTER (WHERE f.ordinal IS NULL)
                   OVER (PARTITION BY f.instance_key) AS s_total
        FROM fresh f
    ),
    -- locked: the per-instance lock that gives concurrent new steps distinct ordinals
    -- (taken in id order: no deadlock between two calls); base is the instance's counter.
    locked AS (
        SELECT p.id, p.instance_key, p.next_ordinal AS base FROM process_instance p
        WHERE p.id IN (SELECT instance_id FROM spans)
          AND p.instance_key IN (SELECT instance_key FROM spans)
        ORDER BY p.id
        FOR UPDATE
    ),
    -- assigned: each new record's ordinal (the client's, or the next one the server has),
    -- and each instance's counter after the call.
    assigned AS (
        SELECT sp.i, sp.instance_key, sp.instance_id, l.id AS locked_id,
               COALESCE(sp.ordinal, sp.s + GREATEST(COALESCE(l.base, 0), sp.a) - 1) AS ordinal,
               sp.s_total + GREATEST(COALESCE(l.base, 0), sp.a_total) AS next_ordinal
        FROM spans sp LEFT JOIN locked l ON l.instance_key = sp.instance_key
    ),
    -- bump: advance the counters of the existing instances.
    bump AS (
        UPDATE process_instance p SET next_ordinal = x.next_ordinal
        FROM (SELECT DISTINCT locked_id, next_ordinal FROM assigned
              WHERE locked_id IS NOT NULL) x
        WHERE p.id = x.locked_id
        RETURNING p.id
    ),
    -- new_instance: create the instances that do not exist, with the ids of their keys, in
    -- id order, so two calls that create the same instances take their ids in the same order
    -- and one waits for the other instead of deadlocking. One created concurrently (its id,
    -- or on one node its key, taken meanwhile: DO NOTHING names no constraint, so every
    -- unique key is its arbiter) is skipped here: its events get no answer row and are called
    -- again, and the next call finds the instance, or answers the collision.
    new_instance AS (
        INSERT INTO process_instance (id, instance_key, next_ordinal)
        SELECT a.instance_id, a.instance_key, max(a.next_ordinal) FROM assigned a
        WHERE NOT EXISTS (SELECT 1 FROM known WHERE known.instance_key = a.instance_key)
        GROUP BY a.instance_id, a.instance_key
        ORDER BY a.instance_id
        ON CONFLICT DO NOTHING
        RETURNING id, instance_key
    ),
    inst AS (
        SELECT id, instance_key FROM new_instance
        UNION ALL
        SELECT id, instance_key FROM known
    ),
    -- ins: create the records, in (instance, slug) order for the same reason. A declare
    -- creates attempt 1, pending; a start or a terminal event creates its own attempt (the
    -- one it names against attempt 1, pending: its own, else 1). A
    -- client ordinal that another step holds fails uq_workflow_step_record_instance_id_ordinal
    -- and aborts the statement; an ordinal past the range is answered ordinal_taken below.
    ins AS (
        INSERT INTO workflow_step_record AS r (
            instance_id, step_slug, ordinal, status, attempt_count, output, external_output_url,
            started_at, completed_at, error_code, error_message, lease_expires_at, created_at,
            updated_at)
        SELECT inst.id, e.step_slug, a.ordinal, e.target,
               judge_event_attempt(e.kind, e.attempt, 1, 'pending'),
               e.output, e.url,
               CASE WHEN e.kind <> 'declare' THEN COALESCE(e.started_at, e.now) END,
               judge_event_completed_at(e.kind, e.completed_at, e.now, e.started_at),
               e.error_code, e.error_message, e.lease_expires_at, e.now, e.now
        FROM assigned a
        JOIN e ON e.i = a.i
        JOIN inst ON inst.instance_key = a.instance_key
        WHERE a.ordinal <= 2147483647
        ORDER BY inst.id, e.step_slug
        RETURNING r.*
    )
    -- The answers: created, applied, judged without a write, and the refusals of events
    -- that have no record.
    SELECT e.i, 'created' AS outcome, false AS recorded,
           ins.id, ins.step_slug, ins.ordinal, ins.status, ins.attempt_count,
           ins.output::text AS output, ins.external_output_url, ins.started_at,
           ins.completed_at, ins.lease_expires_at, ins.error_code,
           ins.error_message, ins.created_at, ins.updated_at
    FROM ins JOIN inst ON inst.id = ins.instance_id
    JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
    UNION ALL
    SELECT upd.i, 'applied', false,
           upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
           upd.output::text AS output, upd.external_output_url, upd.started_at,
           upd.completed_at, upd.lease_expires_at, upd.error_code,
           upd.error_message, upd.created_at, upd.updated_at
    FROM upd
    UNION ALL
    SELECT d.i, d.outcome, EXISTS (SELECT 1 FROM late_recorded r WHERE r.i = d.i),
           cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count,
           cur.output::text AS output, cur.external_output_url, cur.started_at,
           cur.completed_at, cur.lease_expires_at, cur.error_code,
           cur.error_message, cur.created_at, cur.updated_at
    FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM e
    WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
      AND NOT EXISTS (SELECT 1 FROM collided c WHERE c.i = e.i)
    UNION ALL
    SELECT a.i, 'ordinal_taken', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM assigned a WHERE a.ordinal > 2147483647
    UNION ALL
    SELECT c.i, 'instance_key_collision', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM collided c;
END
$fn$;


-- ===== app/sql/attempt_history.sql as of revision 0022 =====
-- The attempt history (workflow_step_attempt): one row per attempt of a record, written by
-- the database itself in the same statement as the record, whoever writes the record.
--
-- Three functions, three triggers:
--   * workflow_step_record_history_insert / _update (statement triggers with transition
--     tables on workflow_step_record): every write to a record — the judge, a batch, the
--     sweeper, a hand-written UPDATE — brings the history up to date, set-based;
--   * workflow_step_attempt_guard (row trigger on workflow_step_attempt): the history is
--     written only by those triggers, and a finished attempt never changes.

-- After records are inserted: the new record's attempt, unless it is pending (a pending
-- record has no attempt yet). The upsert is shared with _update below: an attempt row
-- exists from the moment its attempt starts and is brought up to date by every write of
-- its record; the WHERE skips writes that change nothing the history shows. A running
-- attempt mirrors the record's lease; a finished one keeps the last lease it held.
CREATE OR REPLACE FUNCTION workflow_step_record_history_insert() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO workflow_step_attempt AS a (
        instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at)
    SELECT n.instance_id, n.id, n.attempt_count, n.status, n.started_at,
           n.completed_at, n.output, n.external_output_url, n.error_code,
           n.error_message, n.lease_expires_at, n.updated_at, n.updated_at
    FROM new_rows n
    WHERE n.status <> 'pending'
    ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
    DO UPDATE SET
        status = EXCLUDED.status,
        started_at = EXCLUDED.started_at,
        completed_at = EXCLUDED.completed_at,
        output = EXCLUDED.output,
        external_output_url = EXCLUDED.external_output_url,
        error_code = EXCLUDED.error_code,
        error_message = EXCLUDED.error_message,
        lease_expires_at = CASE WHEN EXCLUDED.status = 'running'
                                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END,
        updated_at = EXCLUDED.updated_at
    WHERE (a.status, a.started_at, a.completed_at, a.output, a.external_output_url,
           a.error_code, a.error_message, a.lease_expires_at)
          IS DISTINCT FROM
          (EXCLUDED.status, EXCLUDED.started_at, EXCLUDED.completed_at, EXCLUDED.output,
           EXCLUDED.external_output_url, EXCLUDED.error_code, EXCLUDED.error_message,
           CASE WHEN EXCLUDED.status = 'running'
                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END);
    RETURN NULL;
END
$fn$;

-- After records are updated: first, a running attempt overtaken by a higher attempt
-- becomes `superseded` (it started and never reported an end; completed_at = when the next
-- attempt took over, never before its own start). Then the record's current attempt is
-- inserted or brought up to date, as after an insert.
CREATE OR REPLACE FUNCTION workflow_step_record_history_update() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE workflow_step_attempt a SET
        status = 'superseded',
        completed_at = GREATEST(a.started_at, COALESCE(n.started_at, n.updated_at)),
        updated_at = n.updated_at
    FROM old_rows o JOIN new_rows n ON n.id = o.id
    WHERE o.status = 'running' AND n.attempt_count > o.attempt_count
      AND a.instance_id = o.instance_id AND a.record_id = o.id
      AND a.attempt = o.attempt_count AND a.status = 'running';

    INSERT INTO workflow_step_attempt AS a (
        instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at)
    SELECT n.instance_id, n.id, n.attempt_count, n.status, n.started_at,
           n.completed_at, n.output, n.external_output_url, n.error_code,
           n.error_message, n.lease_expires_at, n.updated_at, n.updated_at
    FROM new_rows n
    WHERE n.status <> 'pending'
    ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_instance_id_record_id_attempt
    DO UPDATE SET
        status = EXCLUDED.status,
        started_at = EXCLUDED.started_at,
        completed_at = EXCLUDED.completed_at,
        output = EXCLUDED.output,
        external_output_url = EXCLUDED.external_output_url,
        error_code = EXCLUDED.error_code,
        error_message = EXCLUDED.error_message,
        lease_expires_at = CASE WHEN EXCLUDED.status = 'running'
                                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END,
        updated_at = EXCLUDED.updated_at
    WHERE (a.status, a.started_at, a.completed_at, a.output, a.external_output_url,
           a.error_code, a.error_message, a.lease_expires_at)
          IS DISTINCT FROM
          (EXCLUDED.status, EXCLUDED.started_at, EXCLUDED.completed_at, EXCLUDED.output,
           EXCLUDED.external_output_url, EXCLUDED.error_code, EXCLUDED.error_message,
           CASE WHEN EXCLUDED.status = 'running'
                THEN EXCLUDED.lease_expires_at ELSE a.lease_expires_at END);
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_history_insert
AFTER INSERT ON workflow_step_record
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_history_insert();

CREATE OR REPLACE TRIGGER tr_workflow_step_record_history_update
AFTER UPDATE ON workflow_step_record
REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION workflow_step_record_history_update();

-- The history's guard, so that it cannot disagree with the record:
--   * it is written only by the record's triggers (trigger depth 2 and more): a
--     hand-written INSERT, UPDATE or DELETE of the history is refused (deleting a record's
--     instance still cascades: the cascade runs as a trigger too);
--   * one exception, the judge's late report of an older attempt (apply_events.sql, its
--     `late` steps), written while the judge runs (steprecord.writer = 'judge', set by
--     the judge's functions for their call only): it may insert an attempt's terminal
--     entry where there was none, or turn a `superseded` entry into its own terminal
--     report, and nothing else;
--   * a finished attempt never changes, and a superseded one only by that late report;
--   * identities never change.
-- It raises check_violation naming tr_workflow_step_attempt_guard, like a CHECK.
CREATE OR REPLACE FUNCTION workflow_step_attempt_guard() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    why text;
    late_report boolean := pg_trigger_depth() < 2
        AND current_setting('steprecord.writer', true) = 'judge'
        AND TG_OP IN ('INSERT', 'UPDATE') AND NEW.status IN ('completed', 'failed');
BEGIN
    IF late_report THEN
        IF TG_OP = 'UPDATE'
           AND (NEW.id, NEW.instance_id, NEW.record_id, NEW.attempt, NEW.created_at)
               IS DISTINCT FROM
               (OLD.id, OLD.instance_id, OLD.record_id, OLD.attempt, OLD.created_at) THEN
            why := 'id, instance_id, record_id, attempt and created_at never change';
        ELSIF TG_OP = 'UPDATE' AND OLD.status <> 'superseded' THEN
            why := 'a late report ends only a superseded attempt; a finished one never changes';
        ELSIF NOT EXISTS (SELECT 1 FROM workflow_step_record r
                          WHERE r.instance_id = NEW.instance_id AND r.id = NEW.record_id
                            AND r.attempt_count > NEW.attempt) THEN
            why := 'a late report is of an attempt older than its record''s';
        END IF;
    ELSIF pg_trigger_depth() < 2 THEN
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
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_attempt_guard
BEFORE INSERT OR UPDATE OR DELETE ON workflow_step_attempt
FOR EACH ROW EXECUTE FUNCTION workflow_step_attempt_guard();


-- ===== app/sql/heartbeat.sql as of revision 0022 =====
-- steprecord_heartbeat: extend the lease of the running attempt each heartbeat names.
--
-- Arguments, one array per field (element n is heartbeat n, all of distinct steps):
--   p_i (the index in the caller's list), p_instance_key, p_step_slug, p_attempt,
--   p_lease_seconds.
-- Answer: one row per heartbeat, its index, the outcome and the record (NULLs when there is
-- none), as steprecord_apply_events answers:
--   applied        the lease now ends at the database clock + lease_seconds;
--   stale_attempt  the heartbeat's attempt is older than the record's: a zombie worker
--                  learns that it was superseded;
--   not_started    no such record, or it is pending;
--   not_running    that attempt finished, or the heartbeat names an attempt that has not
--                  started.
-- A heartbeat never changes status, times or attempt_count, so it cannot move a record
-- backwards or reopen it; it is decided under the record's row lock, so it cannot extend
-- a lease that a concurrent terminal event or the sweeper has just closed.
CREATE OR REPLACE FUNCTION steprecord_heartbeat(
    p_i int[], p_instance_key text[], p_step_slug text[], p_attempt bigint[],
    p_lease_seconds int[]
)
RETURNS TABLE (
    i integer, outcome text,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value (no clock call inside a write: see apply_events.sql).
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    WITH e AS MATERIALIZED (
        SELECT x.*, steprecord_instance_id(x.instance_key) AS instance_id, v_now AS now
        FROM unnest(p_i, p_instance_key, p_step_slug, p_attempt, p_lease_seconds)
            AS x(i, instance_key, step_slug, attempt, lease_seconds)
    ),
    -- The records, locked in id order (no deadlock between two calls).
    cur AS (
        SELECT e.i, r.* FROM e
        JOIN process_instance p ON p.id = e.instance_id AND p.instance_key = e.instance_key
        JOIN workflow_step_record r ON r.instance_id = p.id AND r.step_slug = e.step_slug
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    dec AS (
        SELECT cur.i, cur.instance_id, cur.id,
            CASE WHEN e.attempt < cur.attempt_count THEN 'stale_attempt'
                 WHEN cur.status = 'pending' THEN 'not_started'
                 WHEN e.attempt > cur.attempt_count OR cur.status <> 'running' THEN 'not_running'
                 ELSE 'applied' END AS outcome
        FROM cur JOIN e ON e.i = cur.i
    ),
    -- Only the lease and updated_at change (the history trigger copies the running
    -- attempt's new lease into its history entry).
    upd AS (
        UPDATE workflow_step_record r SET
            lease_expires_at = judge_lease_expires_at(e.now, e.lease_seconds),
            updated_at = e.now
        FROM dec d JOIN e ON e.i = d.i
        WHERE r.instance_id = d.instance_id AND r.id = d.id AND d.outcome = 'applied'
        RETURNING d.i, r.*
    )
    SELECT upd.i, 'applied' AS outcome,
           upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
           upd.output::text AS output, upd.external_output_url, upd.started_at,
           upd.completed_at, upd.lease_expires_at, upd.error_code,
           upd.error_message, upd.created_at, upd.updated_at
    FROM upd
    UNION ALL
    SELECT d.i, d.outcome,
           cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count,
           cur.output::text AS output, cur.external_output_url, cur.started_at,
           cur.completed_at, cur.lease_expires_at, cur.error_code,
           cur.error_message, cur.created_at, cur.updated_at
    FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started',
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM e
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i);
END
$fn$;


-- ===== app/sql/judge_rules.sql as of revision 0022 =====
-- The judge's rules, each stated once: small LANGUAGE sql functions that both entry points of
-- the judge (steprecord_apply_event, steprecord_apply_events) and the record's transition
-- guard (record_guard.sql) call. Each is one expression over its arguments, with no SET
-- clause, not STRICT and no stronger volatility than its body, so PostgreSQL inlines it into
-- the statement that calls it when it plans that statement: the rule costs what its
-- expression costs, as if written out in place (a generic plan is made once per connection).
--
-- Positions. A record sits at (attempt_count, rank of its status); an event at (its attempt,
-- rank of the status it leads to). Pairs compare left to right: an event newer than the
-- record is applied, one at the same position is a replay or a conflict, an older one is a
-- late report or stale.

-- A status's rank within its attempt: pending 0, running 1, finished (completed, failed) 2.
CREATE OR REPLACE FUNCTION judge_status_rank(p_status text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE p_status WHEN 'pending' THEN 0 WHEN 'running' THEN 1 ELSE 2 END
$fn$;

-- The status an event of a kind leads to: declare pending, start running, complete
-- completed, fail failed.
CREATE OR REPLACE FUNCTION judge_event_status(p_kind text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE p_kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                       WHEN 'complete' THEN 'completed' ELSE 'failed' END
$fn$;

-- The attempt an event speaks of, against a record at (r_attempt_count, r_status): a declare
-- takes the record's; an event's own attempt, when it sends one; else a start takes the next
-- (a pending record's own attempt_count, which no start has begun yet), and a complete or
-- fail the record's current attempt. A new record is judged as attempt 1, pending.
CREATE OR REPLACE FUNCTION judge_event_attempt(
    p_kind text, p_attempt bigint, r_attempt_count integer, r_status text
) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN p_kind = 'declare' THEN r_attempt_count
                WHEN p_attempt IS NOT NULL THEN p_attempt
                WHEN p_kind = 'start' THEN r_attempt_count::bigint + (r_status <> 'pending')::int
                ELSE r_attempt_count END
$fn$;

-- The start time an event gives the record: its own; else, for a start, the clock (p_now);
-- else, for a complete or fail of the attempt that is running, that attempt's start; else
-- none (a complete or fail with no start known is not_started).
CREATE OR REPLACE FUNCTION judge_event_started_at(
    p_kind text, p_attempt bigint, p_started_at timestamptz, p_now timestamptz,
    r_attempt_count integer, r_status text, r_started_at timestamptz
) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT COALESCE(
        p_started_at,
        CASE WHEN p_kind = 'start' THEN p_now
             WHEN judge_event_attempt(p_kind, p_attempt, r_attempt_count, r_status)
                  = r_attempt_count AND r_status = 'running' THEN r_started_at
        END)
$fn$;

-- The end time of a complete or fail (NULL for a declare or start): its own, else the later
-- of the clock and its start, so that a record's or an attempt's times stay in order.
CREATE OR REPLACE FUNCTION judge_event_completed_at(
    p_kind text, p_completed_at timestamptz, p_now timestamptz, p_started_at timestamptz
) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN p_kind IN ('complete', 'fail')
                THEN COALESCE(p_completed_at, GREATEST(p_now, p_started_at)) END
$fn$;

-- When a lease ends: p_lease_seconds from the clock (a start's, or a heartbeat's that
-- extends it). Every other event sends none, and so clears the lease (NULL).
CREATE OR REPLACE FUNCTION judge_lease_expires_at(
    p_now timestamptz, p_lease_seconds integer
) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $fn$
    SELECT p_now + p_lease_seconds * interval '1 second'
$fn$;

-- Whether two reports of one attempt say the same: the same status and content (the output
-- compared as jsonb, so key order and spacing do not matter; times are not content).
CREATE OR REPLACE FUNCTION judge_same_report(
    a_status text, a_output jsonb, a_external_output_url text, a_error_code text,
    a_error_message text,
    b_status text, b_output jsonb, b_external_output_url text, b_error_code text,
    b_error_message text
) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT a_status = b_status
           AND a_output IS NOT DISTINCT FROM b_output
           AND a_external_output_url IS NOT DISTINCT FROM b_external_output_url
           AND a_error_code IS NOT DISTINCT FROM b_error_code
           AND a_error_message IS NOT DISTINCT FROM b_error_message
$fn$;

-- The judgement of an event (p_*) against the record it names (r_*), at the clock p_now:
--   newer  -> applied; but an attempt past 2147483647 is a conflict (no attempt left), and a
--             complete or fail with no start known is not_started;
--   same   -> a declare or start is a replay; a complete or fail is a replay only when it is
--             the same report as the record's (judge_same_report), else a conflict;
--   older  -> of the record's own attempt (a late start or declare): a replay; of an older
--             attempt: stale_attempt, so a zombie worker learns it was superseded.
CREATE OR REPLACE FUNCTION judge_outcome(
    p_kind text, p_attempt bigint, p_started_at timestamptz, p_now timestamptz,
    p_output jsonb, p_external_output_url text, p_error_code text, p_error_message text,
    r_attempt_count integer, r_status text, r_started_at timestamptz,
    r_output jsonb, r_external_output_url text, r_error_code text, r_error_message text
) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE
        WHEN (judge_event_attempt(p_kind, p_attempt, r_attempt_count, r_status),
              judge_status_rank(judge_event_status(p_kind)))
             > (r_attempt_count, judge_status_rank(r_status)) THEN
            CASE WHEN judge_event_attempt(p_kind, p_attempt, r_attempt_count, r_status)
                      > 2147483647 THEN 'conflict'
                 WHEN p_kind IN ('complete', 'fail')
                      AND judge_event_started_at(p_kind, p_attempt, p_started_at, p_now,
                                                      r_attempt_count, r_status, r_started_at)
                          IS NULL THEN 'not_started'
                 ELSE 'applied' END
        WHEN (judge_event_attempt(p_kind, p_attempt, r_attempt_count, r_status),
              judge_status_rank(judge_event_status(p_kind)))
             = (r_attempt_count, judge_status_rank(r_status)) THEN
            CASE WHEN p_kind IN ('declare', 'start') THEN 'replay'
                 WHEN judge_same_report(
                          judge_event_status(p_kind), p_output, p_external_output_url,
                          p_error_code, p_error_message,
                          r_status, r_output, r_external_output_url, r_error_code,
                          r_error_message) THEN 'replay'
                 ELSE 'conflict' END
        WHEN judge_event_attempt(p_kind, p_attempt, r_attempt_count, r_status)
             = r_attempt_count THEN 'replay'
        ELSE 'stale_attempt'
    END
$fn$;
