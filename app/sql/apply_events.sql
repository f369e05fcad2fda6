-- steprecord_apply_events: the judge of a set of events, in one statement (one node's batches).
--
-- Arguments, one array per field, all of the same length (element n is event n):
--   p_i (the event's index in the caller's list), p_instance_key, p_step_slug,
--   p_kind ('declare' | 'start' | 'complete' | 'fail'), p_attempt, p_started_at,
--   p_completed_at, p_output (JSON text), p_external_output_url, p_error_code,
--   p_error_message, p_ordinal, p_lease_seconds. NULL means "not sent".
-- Then one scalar, p_trace_id (default NULL): the W3C trace id (32 lowercase hex digits) of
-- the request that sent the events, or NULL when it had none. An attempt that an event
-- starts keeps it (workflow_step_attempt.trace_id; see the first step below).
-- Then p_reported_by (default NULL): the writer, the name of the token whose request sent the
-- events (`anonymous` without tokens). Every record this call writes takes it as its
-- updated_by (its history entry follows, attempt_history.sql), and a late report's entry as
-- its reported_by. NULL: the caller named none (a hand-written call may; the service always
-- names one), and what it writes shows no writer, as rows written before writers were kept.
-- Then p_labels (default NULL: none sent), one element per event: the event's labels, a JSON
-- object of strings, or NULL. The labels of the events answered 2xx (created, applied,
-- replay) merge into their instance's, in event order (a key named again takes the later
-- value; a key no event names stays as it is): `merged` and `bump` below.
--
-- The events must be of distinct steps: each is judged as if alone (the caller splits a
-- list where a step repeats, so later events of a step see the earlier ones' effects).
--
-- Answer: one row per event (a steprecord_judged, answers.sql), its index `i`, the `outcome`,
-- whether a late report was `recorded` in the history (below), and the record after the event
-- (or as it stands, when the event was refused; NULLs when there is none), its columns as
-- app/core/record.py lists them:
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
-- The two inserts of records and history entries name their id, the identity's next value
-- (OVERRIDING SYSTEM VALUE), as steprecord_apply_event's do.
--
-- One node judges a batch with it. On Citus the service sends each event of a batch to
-- steprecord_apply_event instead: this statement writes in WITH parts (an INSERT among them),
-- which Citus plans part by part and whose row locks it refuses across shards.
--
-- plan_cache_mode = force_generic_plan: every access is by key, so the plan does not depend
-- on the arrays' contents; one generic plan, made once per connection, serves every call
-- (a custom plan would be made again, at the full planning cost, on every call).
-- steprecord.writer = 'judge' and steprecord.trace_id, for the call only: set first by
-- set_config, and the values they had before restored after the statement. The history's
-- guard lets the judge write a late report into the history (attempt_history.sql); the
-- trace id is this call's (below). Set in the body, not by `SET` clauses of the function: a
-- `SET` clause of a setting no extension defines (a placeholder) needs a superuser or
-- `GRANT SET ON PARAMETER` to create the function, and the service migrates as the
-- database's owner with no other right. (A call that fails rolls them back with itself.)
CREATE OR REPLACE FUNCTION steprecord_apply_events(
    p_i int[], p_instance_key text[], p_step_slug text[], p_kind text[], p_attempt bigint[],
    p_started_at timestamptz[], p_completed_at timestamptz[], p_output text[],
    p_external_output_url text[], p_error_code text[], p_error_message text[],
    p_ordinal bigint[], p_lease_seconds int[], p_trace_id text DEFAULT NULL,
    p_reported_by text DEFAULT NULL, p_labels jsonb[] DEFAULT NULL
) RETURNS SETOF steprecord_judged
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- One clock reading per call, a value (clock_timestamp, not now(): a retried call in the
    -- same transaction reads anew). The statement below uses it, never a clock call: Citus
    -- refuses a VOLATILE function in an UPDATE of a distributed table, and any but an
    -- IMMUTABLE one in an upsert's DO UPDATE SET.
    v_now timestamptz := clock_timestamp();
    -- The events' instance ids (instance_id.sql), a value every read and write below names
    -- (`= ANY (v_ids)`): on Citus, where the function plans each statement with its values
    -- (force_custom_plan), a call whose instances share one shard group runs there alone,
    -- which is what lets it lock rows (FOR UPDATE) and write in one statement. On one node
    -- the condition repeats what the keys already say.
    v_ids bigint[] := ARRAY(SELECT DISTINCT steprecord_instance_id(k) FROM unnest(p_instance_key) k);
    -- The settings as the caller left them, restored at the end.
    v_writer text := current_setting('steprecord.writer', true);
    v_trace text := current_setting('steprecord.trace_id', true);
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
               x.error_message, x.ordinal, x.labels,
               judge_lease_expires_at(v_now, x.lease_seconds) AS lease_expires_at,
               v_now AS now,
               judge_event_status(x.kind) AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM unnest(
            p_i, p_instance_key, p_step_slug, p_kind, p_attempt, p_started_at, p_completed_at,
            p_output, p_external_output_url, p_error_code, p_error_message, p_ordinal,
            p_lease_seconds, p_labels
        ) AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
               error_code, error_message, ordinal, lease_seconds, labels)
    ),
    -- held: the instances that hold the events' ids (as this statement's snapshot sees
    -- them); known: those of the events' own keys. An id held by another key's instance is
    -- a collision: its events are answered so, and write nothing.
    held AS (
        SELECT p.id, p.instance_key FROM process_instance p
        WHERE p.id = ANY (v_ids) AND p.id IN (SELECT instance_id FROM e)
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
        WHERE r.instance_id = ANY (v_ids)
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
            updated_at = d.now,
            updated_by = p_reported_by
        FROM dec d
        WHERE r.instance_id = ANY (v_ids)
          AND r.instance_id = d.instance_id AND r.id = d.id AND d.outcome = 'applied'
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
            ON h.instance_id = ANY (v_ids)
           AND h.instance_id = cur.instance_id AND h.record_id = cur.id
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
    -- `late` read the entry with this statement's snapshot, which may be older than the row
    -- lock `cur` waited for: a higher attempt that took the record over meanwhile superseded
    -- the entry in its own transaction, after the snapshot (it read `running` then, or
    -- nothing). So only a terminal entry, which never changes, is skipped here; for any other
    -- the upsert decides on the entry's newest version (ON CONFLICT sees it, and its WHERE
    -- reads it), as the record's row lock makes it final.
    late_write AS (
        INSERT INTO workflow_step_attempt AS a (
            id, instance_id, record_id, attempt, status, started_at, completed_at, output,
            external_output_url, error_code, error_message, created_at, updated_at, reported_by)
        OVERRIDING SYSTEM VALUE
        SELECT nextval('workflow_step_attempt_id_seq'), l.instance_id, l.record_id, l.attempt, l.target, l.started_at, l.completed_at,
               l.output, l.url, l.error_code, l.error_message, l.now, l.now, p_reported_by
        FROM late l
        WHERE (l.entry_status IS NULL OR l.entry_status IN ('running', 'superseded'))
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
            updated_at = EXCLUDED.updated_at,
            reported_by = EXCLUDED.reported_by
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
    -- relabel: the labels that the events of existing records answered 2xx (applied, replay)
    -- bring to each instance, in event order (jsonb_object_agg keeps a key's last value).
    relabel AS (
        SELECT e.instance_id, jsonb_object_agg(kv.key, kv.value ORDER BY e.i) AS labels
        FROM dec d JOIN e ON e.i = d.i, jsonb_each(e.labels) kv
        WHERE d.outcome IN ('applied', 'replay')
        GROUP BY e.instance_id
    ),
    -- locked: the per-instance lock that gives concurrent new steps distinct ordinals, and
    -- the lock of an instance whose labels change (taken in id order: no deadlock between
    -- two calls; after the records' locks in `cur`, as steprecord_apply_event takes them);
    -- base is the instance's counter. An instance whose labels already hold what its
    -- events bring is not locked for them (nor written).
    locked AS (
        SELECT p.id, p.instance_key, p.next_ordinal AS base FROM process_instance p
        WHERE p.id = ANY (v_ids)
          AND ((p.id IN (SELECT instance_id FROM spans)
                AND p.instance_key IN (SELECT instance_key FROM spans))
               OR EXISTS (SELECT 1 FROM relabel x
                          WHERE x.instance_id = p.id AND NOT p.labels @> x.labels))
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
    -- merged: each instance's labels from its events answered 2xx, the records they
    -- created (within the ordinals' range) among them, in event order.
    merged AS (
        SELECT l.instance_id, jsonb_object_agg(kv.key, kv.value ORDER BY l.i) AS labels
        FROM (SELECT d.i, e.instance_id, e.labels FROM dec d JOIN e ON e.i = d.i
              WHERE d.outcome IN ('applied', 'replay')
              UNION ALL
              SELECT a.i, a.instance_id, e.labels FROM assigned a JOIN e ON e.i = a.i
              WHERE a.ordinal <= 2147483647) l,
             jsonb_each(l.labels) kv
        GROUP BY l.instance_id
    ),
    -- bump: advance the counters of the existing instances, and merge their labels (one
    -- UPDATE of each row: a statement updates a row once). A counter no new step moves and
    -- labels no event brings stay as they are.
    bump AS (
        UPDATE process_instance p
        SET next_ordinal = coalesce(x.next_ordinal, p.next_ordinal),
            labels = p.labels || coalesce(m.labels, '{}')
        FROM locked l
        LEFT JOIN (SELECT DISTINCT locked_id, next_ordinal FROM assigned
                   WHERE locked_id IS NOT NULL) x ON x.locked_id = l.id
        LEFT JOIN merged m ON m.instance_id = l.id
        WHERE p.id = ANY (v_ids) AND p.id = l.id
        RETURNING p.id
    ),
    -- new_instance: create the instances that do not exist, with the ids of their keys, in
    -- id order, so two calls that create the same instances take their ids in the same order
    -- and one waits for the other instead of deadlocking. One created concurrently (its id,
    -- or on one node its key, taken meanwhile: DO NOTHING names no constraint, so every
    -- unique key is its arbiter) is skipped here: its events get no answer row and are called
    -- again, and the next call finds the instance, or answers the collision.
    new_instance AS (
        INSERT INTO process_instance (id, instance_key, next_ordinal, labels)
        SELECT a.instance_id, a.instance_key, max(a.next_ordinal),
               coalesce((SELECT m.labels FROM merged m WHERE m.instance_id = a.instance_id), '{}')
        FROM assigned a
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
            id, instance_id, step_slug, ordinal, status, attempt_count, output,
            external_output_url, started_at, completed_at, error_code, error_message,
            lease_expires_at, created_at, updated_at, updated_by)
        OVERRIDING SYSTEM VALUE
        SELECT nextval('workflow_step_record_id_seq'), inst.id, e.step_slug, a.ordinal, e.target,
               judge_event_attempt(e.kind, e.attempt, 1, 'pending'),
               e.output, e.url,
               CASE WHEN e.kind <> 'declare' THEN COALESCE(e.started_at, e.now) END,
               judge_event_completed_at(e.kind, e.completed_at, e.now, e.started_at),
               e.error_code, e.error_message, e.lease_expires_at, e.now, e.now, p_reported_by
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
           ins.error_message, ins.created_at, ins.updated_at, ins.updated_by
    FROM ins JOIN inst ON inst.id = ins.instance_id
    JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
    UNION ALL
    SELECT upd.i, 'applied', false,
           upd.id, upd.step_slug, upd.ordinal, upd.status, upd.attempt_count,
           upd.output::text AS output, upd.external_output_url, upd.started_at,
           upd.completed_at, upd.lease_expires_at, upd.error_code,
           upd.error_message, upd.created_at, upd.updated_at, upd.updated_by
    FROM upd
    UNION ALL
    SELECT d.i, d.outcome, EXISTS (SELECT 1 FROM late_recorded r WHERE r.i = d.i),
           cur.id, cur.step_slug, cur.ordinal, cur.status, cur.attempt_count,
           cur.output::text AS output, cur.external_output_url, cur.started_at,
           cur.completed_at, cur.lease_expires_at, cur.error_code,
           cur.error_message, cur.created_at, cur.updated_at, cur.updated_by
    FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL
    FROM e
    WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
      AND NOT EXISTS (SELECT 1 FROM collided c WHERE c.i = e.i)
    UNION ALL
    SELECT a.i, 'ordinal_taken', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL
    FROM assigned a WHERE a.ordinal > 2147483647
    UNION ALL
    SELECT c.i, 'instance_key_collision', false,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL
    FROM collided c;
    PERFORM set_config('steprecord.writer', coalesce(v_writer, ''), true);
    PERFORM set_config('steprecord.trace_id', coalesce(v_trace, ''), true);
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_apply_events FROM PUBLIC;
