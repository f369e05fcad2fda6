-- Revision 0014, upgrade: the frozen copy of app/sql/ files this revision installs (late
-- reports of superseded attempts). Never edit it: the current source is app/sql/.

-- The judge's functions answer a new column (recorded): a result type is changed by
-- dropping and creating.
DROP FUNCTION steprecord_apply_events(
    int[], text[], text[], text[], bigint[], timestamptz[], timestamptz[], text[],
    text[], text[], text[], bigint[], int[]
);
DROP FUNCTION steprecord_apply_event(
    int, text, text, text, bigint, timestamptz, timestamptz, text, text, text, text, bigint, int
);

-- ===== app/sql/apply_events.sql =====
-- steprecord_apply_events: the judge of a set of events, in one statement.
--
-- Arguments, one array per field, all of the same length (element n is event n):
--   $1 i (the event's index in the caller's list), $2 instance_key, $3 step_slug,
--   $4 kind ('declare' | 'start' | 'complete' | 'fail'), $5 attempt, $6 started_at,
--   $7 completed_at, $8 output (JSON text), $9 external_output_url, $10 error_code,
--   $11 error_message, $12 ordinal, $13 lease_seconds. NULL means "not sent".
--
-- The events must be of distinct steps: each is judged as if alone (the caller splits a
-- list where a step repeats, so later events of a step see the earlier ones' effects).
--
-- Answer: one row per event, its index `i`, the `outcome`, whether a late report was
-- `recorded` in the history (below), and the record after the event (or as it stands, when
-- the event was refused; NULLs when there is none):
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
--   ordinal_taken  no server-assigned ordinal is left (past 2147483647): nothing written.
-- An event with no answer row lost a race with a concurrent creator of its instance (this
-- statement's snapshot cannot see the new instance row): the caller calls again with it,
-- and the next snapshot sees it. A constraint the database refuses (a bad value, a unique
-- key taken by a concurrent creator of the same step, a deadlock) aborts the statement:
-- nothing of it was written.
--
-- Positions: a record sits at (attempt_count, rank), rank pending 0, running 1, completed
-- or failed 2; an event at (attempt, k), k declare 0, start 1, complete/fail 2. Pairs
-- compare left to right.
--
-- plan_cache_mode = force_generic_plan: every access is by key, so the plan does not depend
-- on the arrays' contents; one generic plan, made once per connection, serves every call
-- (a custom plan would be made again, at the full planning cost, on every call).
-- steprecord.writer = 'judge', for the call only: the history's guard lets the judge, and
-- nothing else, write a late report into the history (attempt_history.sql).
CREATE OR REPLACE FUNCTION steprecord_apply_events(
    int[], text[], text[], text[], bigint[], timestamptz[], timestamptz[], text[],
    text[], text[], text[], bigint[], int[]
) RETURNS TABLE (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    error_code text, error_message text, created_at timestamptz, updated_at timestamptz,
    lease_expires_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
BEGIN
    PERFORM set_config('steprecord.writer', 'judge', true);
    RETURN QUERY
    -- e: the events, with what every later step needs of them. One clock reading per call
    -- (clock_timestamp, not now(): a retried call in the same transaction reads anew).
    -- A start's lease runs from the database clock; every other event clears the lease
    -- (lease_seconds is NULL). Only a declare, a start, or a complete/fail that brings its
    -- own started_at may create a record: a record never exists without its start time.
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
        FROM unnest(
            $1::int[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::timestamptz[],
            $7::timestamptz[], $8::text[], $9::text[], $10::text[], $11::text[], $12::bigint[],
            $13::int[]
        ) AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
               error_code, error_message, ordinal, lease_seconds)
    ),
    -- known: the instances that exist already (as this statement's snapshot sees them).
    known AS (
        SELECT p.id, p.instance_key FROM process_instance p
        WHERE p.instance_key IN (SELECT instance_key FROM e)
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
    -- dec: the judgement of each event whose record exists, with the values an update
    -- writes (so `upd` reads `dec` alone, one lookup per record, whatever the call's size).
    --   a_e: the event's attempt. A declare takes the record's. A start without one takes
    --        the next (attempt_count + 1; a pending record's own attempt_count); a
    --        complete/fail without one takes the record's current attempt.
    --   started_at: the event's own; else, for a start, the clock; else, for a terminal
    --        event of the running attempt, the running record's start.
    --   outcome:
    --     newer  -> applied; but an attempt past 2147483647 is a conflict (no attempt left)
    --               and a complete/fail with no start known is not_started;
    --     same   -> a declare or start is a replay; a complete/fail is a replay only with
    --               the same status and content (output compared as jsonb, so key order and
    --               spacing do not matter; times are not content), else a conflict;
    --     older  -> of the record's own attempt (a late start or declare): a replay;
    --               of an older attempt: stale_attempt, so a zombie worker learns it was
    --               superseded.
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
    -- upd: write what was applied, and nothing else (a replay or a refusal leaves
    -- updated_at as it was). The event replaces the whole state: a higher attempt starts
    -- afresh, so the previous attempt's times, output and error are cleared. A missing
    -- completed_at is the later of the clock and started_at (timing stays ordered). The
    -- record's triggers keep the history and notify the stream in the same statement.
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
    -- late: the complete/fail reports of an attempt older than the record's (stale), with
    -- that attempt's history entry (h), under the record's row lock taken in `cur`, so no
    -- other writer of this record's history runs meanwhile. The report's times: its own
    -- completed_at, else the later of the clock and the start known; its own started_at,
    -- else the entry's, else (nothing known) its completed_at.
    late AS (
        SELECT d.i, cur.instance_id, cur.id AS record_id, d.a_e AS attempt, e.target, e.now,
               e.output, e.url, e.error_code, e.error_message, h.status AS entry_status,
               h.output AS entry_output, h.external_output_url AS entry_url,
               h.error_code AS entry_error_code, h.error_message AS entry_error_message,
               t.completed_at, COALESCE(e.started_at, h.started_at, t.completed_at) AS started_at
        FROM dec d JOIN cur ON cur.i = d.i JOIN e ON e.i = d.i
        LEFT JOIN workflow_step_attempt h ON h.record_id = cur.id AND h.attempt = d.a_e,
            LATERAL (SELECT COALESCE(
                e.completed_at, GREATEST(e.now, COALESCE(e.started_at, h.started_at))
            ) AS completed_at) t
        WHERE d.outcome = 'stale_attempt' AND e.k = 2
    ),
    -- late_write: a missing entry is inserted, a superseded one becomes the report; a
    -- terminal entry is left as it is (the WHERE of the upsert), and a report whose start
    -- would follow its end writes nothing.
    late_write AS (
        INSERT INTO workflow_step_attempt AS a (
            instance_id, record_id, attempt, status, started_at, completed_at, output,
            external_output_url, error_code, error_message, created_at, updated_at)
        SELECT l.instance_id, l.record_id, l.attempt, l.target, l.started_at, l.completed_at,
               l.output, l.url, l.error_code, l.error_message, l.now, l.now
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
    ),
    -- late_recorded: the report is in the history now, written here or there already (the
    -- same status and content: a duplicate of a late report is recorded as the first was).
    late_recorded AS (
        SELECT l.i FROM late l
        WHERE EXISTS (SELECT 1 FROM late_write w
                      WHERE w.record_id = l.record_id AND w.attempt = l.attempt)
           OR (l.entry_status = l.target
               AND l.entry_output IS NOT DISTINCT FROM l.output
               AND l.entry_url IS NOT DISTINCT FROM l.url
               AND l.entry_error_code IS NOT DISTINCT FROM l.error_code
               AND l.entry_error_message IS NOT DISTINCT FROM l.error_message)
    ),
    -- fresh: the events that create a record. s counts, per instance and in event order,
    -- the new steps whose ordinal the server assigns.
    fresh AS (
        SELECT e.i, e.instance_key, e.ordinal,
               count(*) FILTER (WHERE e.ordinal IS NULL)
                   OVER (PARTITION BY e.instance_key ORDER BY e.i) AS s
        FROM e
        WHERE e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
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
        WHERE p.instance_key IN (SELECT instance_key FROM spans)
        ORDER BY p.id
        FOR UPDATE
    ),
    -- assigned: each new record's ordinal (the client's, or the next one the server has),
    -- and each instance's counter after the call.
    assigned AS (
        SELECT sp.i, sp.instance_key, l.id AS locked_id,
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
    -- new_instance: create the instances that do not exist, in key order, so two calls
    -- that create the same instances take their keys in the same order and one waits for
    -- the other instead of deadlocking. One created concurrently is skipped here (its
    -- events get no answer row and are called again).
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
    -- ins: create the records, in (instance, slug) order for the same reason. A declare
    -- creates attempt 1, pending; a start or a terminal event creates its own attempt. A
    -- client ordinal that another step holds fails uq_workflow_step_record_instance_id_ordinal
    -- and aborts the statement; an ordinal past the range is answered ordinal_taken below.
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
    -- The answers: created, applied, judged without a write, and the refusals of events
    -- that have no record.
    SELECT e.i, 'created' AS outcome, false AS recorded,
           ins.id, ins.step_slug, ins.ordinal, ins.status, ins.attempt_count,
           ins.output::text AS output, ins.external_output_url, ins.started_at,
           ins.completed_at, ins.error_code, ins.error_message, ins.created_at,
           ins.updated_at, ins.lease_expires_at
    FROM ins JOIN inst ON inst.id = ins.instance_id
    JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
    UNION ALL
    SELECT upd.i, 'applied', false,
           upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
           upd.output::text AS output, upd.external_output_url, upd.started_at,
           upd.completed_at, upd.error_code, upd.error_message, upd.created_at,
           upd.updated_at, upd.lease_expires_at
    FROM upd
    UNION ALL
    SELECT d.i, d.outcome, EXISTS (SELECT 1 FROM late_recorded r WHERE r.i = d.i),
           cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count,
           cur.output::text AS output, cur.external_output_url, cur.started_at,
           cur.completed_at, cur.error_code, cur.error_message, cur.created_at,
           cur.updated_at, cur.lease_expires_at
    FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM e
    WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
    UNION ALL
    SELECT a.i, 'ordinal_taken', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM assigned a WHERE a.ordinal > 2147483647;
END
$fn$;

-- ===== app/sql/apply_event.sql =====
-- steprecord_apply_event: the judge of one event (every POST .../declare, /start,
-- /complete, /fail), in at most two statements.
--
-- Arguments: the fields of steprecord_apply_events (apply_events.sql) as scalars, in the
-- same order: $1 i, $2 instance_key, $3 step_slug, $4 kind, $5 attempt, $6 started_at,
-- $7 completed_at, $8 output (JSON text), $9 external_output_url, $10 error_code,
-- $11 error_message, $12 ordinal, $13 lease_seconds.
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
    int, text, text, text, bigint, timestamptz, timestamptz, text, text, text, text, bigint, int
) RETURNS TABLE (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    error_code text, error_message text, created_at timestamptz, updated_at timestamptz,
    lease_expires_at timestamptz
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    judged record;
BEGIN
    PERFORM set_config('steprecord.writer', 'judge', true);
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

-- ===== app/sql/attempt_history.sql =====
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
    ON CONFLICT ON CONSTRAINT uq_workflow_step_attempt_record_id_attempt DO UPDATE SET
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
      AND a.record_id = o.id AND a.attempt = o.attempt_count AND a.status = 'running';

    INSERT INTO workflow_step_attempt AS a (
        instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
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
                          WHERE r.id = NEW.record_id AND r.attempt_count > NEW.attempt) THEN
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
