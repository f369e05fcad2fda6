-- Revision 0038_judged_type, upgrade: the files of app/sql/ that changed since revision
-- 0037, whole.
-- Made by `python -m app.sql freeze 0038_judged_type`. Never edit it: the source is app/sql/;
-- change it there and freeze a new revision.

-- Functions whose arguments or result change, or that go away:
DROP FUNCTION steprecord_apply_event(p_instance_id bigint, p_i int, p_instance_key text, p_step_slug text, p_kind text, p_attempt bigint, p_started_at timestamptz, p_completed_at timestamptz, p_output text, p_external_output_url text, p_error_code text, p_error_message text, p_ordinal bigint, p_lease_seconds int, p_trace_id text, p_reported_by text, p_labels jsonb);
DROP FUNCTION steprecord_apply_events(p_i int[], p_instance_key text[], p_step_slug text[], p_kind text[], p_attempt bigint[], p_started_at timestamptz[], p_completed_at timestamptz[], p_output text[], p_external_output_url text[], p_error_code text[], p_error_message text[], p_ordinal bigint[], p_lease_seconds int[], p_trace_id text, p_reported_by text, p_labels jsonb[]);

-- ===== app/sql/answers.sql =====
-- steprecord_judged: the judge's answer row, declared once. Both judge functions,
-- steprecord_apply_event (apply_event.sql) and steprecord_apply_events (apply_events.sql),
-- return SETOF it: per event its index `i`, the `outcome`, whether a late report was
-- `recorded`, then the record's stored columns in the API's order (app/core/record.py;
-- tests/test_record_shape.py holds this type to it, and the other functions that answer
-- records, whose rows differ, to the same columns).
--
-- A caller reads `SELECT * FROM steprecord_apply_event(...)`: the same columns, names and
-- types as the `RETURNS TABLE` the two functions declared before revision 0038, so a
-- statement a running service prepared before that revision is planned again, not refused.
--
-- PostgreSQL has no CREATE OR REPLACE TYPE: a revision that changes this file drops the type,
-- and first every function whose arguments or result name it, and creates them all again
-- (`python -m app.sql freeze` writes those drops). This file's name sorts before the files
-- of those functions: app/sql/ is installed in name order, and a function's result type
-- must exist when the function is created.
CREATE TYPE steprecord_judged AS (
    i integer, outcome text, recorded boolean,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text
);

-- ===== app/sql/apply_event.sql =====
-- steprecord_apply_event: the judge of one event (every POST .../declare, /start,
-- /complete, /fail, and on Citus each event of a batch), on the judge's own rules
-- (judge_rules.sql), the same answers as a one-element call of steprecord_apply_events
-- (apply_events.sql), which one node uses for a batch.
--
-- Arguments: p_instance_id, the instance's id (steprecord_instance_id(p_instance_key): the
-- service's statement computes it so), then the fields of steprecord_apply_events as
-- scalars, in the same order and with the same names (p_i, p_instance_key, ...
-- p_lease_seconds), then p_trace_id (default NULL): the request's trace id, which the
-- attempt this event starts keeps, then p_reported_by (default NULL): the writer, the name of
-- the token whose request sent the event (`anonymous` without tokens), which the record's
-- updated_by takes when the event writes it (NULL: the caller named none, as a hand-written
-- call may; the service always names one). On Citus p_instance_id is the function's
-- distribution argument: the coordinator sends the whole call to the worker that holds the
-- instance. The statements use the id of the key itself (v_id), so a hand-written call with
-- another id is judged by its key, as steprecord_apply_events judges it.
-- Last, p_labels (default NULL): the event's labels, a JSON object of strings, which merge
-- into its instance's (6 below).
--
-- Every statement reads or writes one table, by its distribution column (`instance_id =
-- v_id`, `id = v_id`), never a join: on Citus an ordinary statement that Citus routes to the
-- instance's shard, takes Citus's locks on that shard's placement, and follows the shard
-- when it moves (on the worker the call was sent to it runs on the local shard; sent to a
-- node that no longer holds the shard, during or after a rebalance, Citus runs it where the
-- shard is). Citus keeps one generic plan per connection for such a "fast path" statement
-- (plan_cache_mode = force_generic_plan, as on one node).
--
-- The steps, under the record's row lock (taken in 1, held until the transaction ends, so
-- every later step judges the record 1 judged):
--   1. find the record, lock it, and judge the event (judge_outcome); a record counts only
--      when its instance is the key's (else the id is another key's: instance_key_collision);
--   2. the event applies: write it, each value from the same rule as the general statement's
--      `upd`;
--   3. a complete/fail of an attempt older than the record's (stale_attempt) is still news
--      of that attempt (a late report): it becomes the attempt's history entry when that is
--      missing or `superseded` (as the general statement's `late_write`);
--   4. otherwise an event that writes nothing: the record as it stands;
--   5. no record: an event that may create one (a declare, a start, or a complete/fail with
--      its started_at) locks its instance, creating it if needed, and looks for the record
--      again (a concurrent creator of the step held that lock and has committed); then takes
--      its ordinal (the client's, or the instance's next) and creates the record. Any other
--      event is not_started.
--   6. an event answered 2xx (created, applied, replay) merges its labels into its
--      instance's (`||`: a key it names takes its value, a key it omits stays); a refused
--      event writes nothing. The instance is written only when the labels change something
--      (`@>`), so an orchestrator that sends the same labels with every event writes them
--      once. Its row lock is taken after the record's, as a batch takes them
--      (apply_events.sql), and only then. A new instance is created with them (5).
-- Answer: one row, a steprecord_judged (answers.sql), as steprecord_apply_events answers.
-- An answer with no row: the instance went away between its creation and its lock (a
-- concurrent DELETE): the caller calls again.
--
-- steprecord.trace_id for the call only, set first by set_config and restored at the end (as
-- in apply_events.sql, which says why not by a `SET` clause): the attempt an update or a new
-- record starts keeps this call's trace id, and so does a late report's new entry.
-- steprecord.writer = 'judge' around the late report's write alone: the history's guard lets
-- the judge, and nothing else, write it (attempt_history.sql).
CREATE OR REPLACE FUNCTION steprecord_apply_event(
    p_instance_id bigint, p_i int, p_instance_key text, p_step_slug text, p_kind text, p_attempt bigint,
    p_started_at timestamptz, p_completed_at timestamptz, p_output text,
    p_external_output_url text, p_error_code text, p_error_message text, p_ordinal bigint,
    p_lease_seconds int, p_trace_id text DEFAULT NULL, p_reported_by text DEFAULT NULL,
    p_labels jsonb DEFAULT NULL
) RETURNS SETOF steprecord_judged
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value: Citus refuses a VOLATILE function (clock_timestamp)
    -- in an UPDATE of a distributed table, and any but an IMMUTABLE one in an upsert's DO
    -- UPDATE SET, so the statements below never call a clock.
    v_now timestamptz := clock_timestamp();
    v_id bigint := steprecord_instance_id(p_instance_key);
    v_status text := judge_event_status(p_kind);
    judged record;
    v_key text;  -- the key of the instance that holds v_id
    v_next bigint;  -- that instance's next server-assigned ordinal
    v_locked boolean := false;  -- the instance is locked (5)
    v_ordinal bigint;
    v_entry record;  -- a late report's attempt in the history (3)
    v_completed_at timestamptz;
    v_started_at timestamptz;
    v_recorded boolean := false;
    v_outcome text;  -- the answer's outcome, for the labels (6)
    v_trace text := current_setting('steprecord.trace_id', true);  -- restored at the end
    v_writer text := current_setting('steprecord.writer', true);
BEGIN
    PERFORM set_config('steprecord.trace_id', coalesce(p_trace_id, ''), true);
    LOOP
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
               r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text AS output, r.external_output_url, r.started_at, r.completed_at,
               r.error_code, r.error_message, r.created_at, r.updated_at, r.updated_by,
               r.lease_expires_at
        INTO judged
        FROM workflow_step_record r
        WHERE r.instance_id = v_id AND r.step_slug = p_step_slug
        FOR UPDATE;
        EXIT WHEN FOUND OR v_locked;

        -- 5. No record. The instance that holds the id, as it stands.
        SELECT p.instance_key INTO v_key FROM process_instance p WHERE p.id = v_id;
        IF FOUND AND v_key <> p_instance_key THEN
            RETURN QUERY SELECT p_i, 'instance_key_collision'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
            EXIT;
        END IF;
        IF NOT (p_kind IN ('declare', 'start') OR p_started_at IS NOT NULL) THEN
            RETURN QUERY SELECT p_i, 'not_started'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
            EXIT;
        END IF;
        -- The instance, created when missing (a concurrent creator's row, once it commits,
        -- makes this insert do nothing), then locked: creators of its steps take their
        -- ordinals one at a time. Its key is read again under the lock: a concurrent creator
        -- may have been another key with the same id.
        IF v_key IS NULL THEN
            INSERT INTO process_instance (id, instance_key, next_ordinal, labels)
            VALUES (v_id, p_instance_key, 0, coalesce(p_labels, '{}'))
            ON CONFLICT DO NOTHING;
        END IF;
        SELECT p.instance_key, p.next_ordinal INTO v_key, v_next
        FROM process_instance p WHERE p.id = v_id
        FOR UPDATE;
        IF NOT FOUND THEN
            EXIT;  -- deleted meanwhile: no answer, the caller calls again
        END IF;
        IF v_key <> p_instance_key THEN
            CONTINUE;  -- answered as a collision above, on the next round
        END IF;
        v_locked := true;
        -- and 1 again, under the instance's lock: a step created meanwhile is judged there.
    END LOOP;

    IF judged.id IS NOT NULL AND NOT v_locked THEN
        -- The record counts only when its instance is the key's.
        PERFORM FROM process_instance p WHERE p.id = v_id AND p.instance_key = p_instance_key;
        IF NOT FOUND THEN
            RETURN QUERY SELECT p_i, 'instance_key_collision'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
            judged := NULL;
        END IF;
    END IF;

    IF judged.id IS NOT NULL AND judged.outcome = 'applied' THEN
        -- 2. Applied: the event replaces the record's whole state, as `upd` does.
        v_outcome := 'applied';
        RETURN QUERY
        UPDATE workflow_step_record r SET
            status = v_status,
            attempt_count = judged.new_attempt,
            started_at = judged.new_started_at,
            completed_at = judge_event_completed_at(p_kind, p_completed_at, v_now,
                                                    judged.new_started_at),
            output = p_output::jsonb,
            external_output_url = p_external_output_url,
            error_code = p_error_code,
            error_message = p_error_message,
            lease_expires_at = judge_lease_expires_at(v_now, p_lease_seconds),
            updated_at = v_now,
            updated_by = p_reported_by
        WHERE r.instance_id = v_id AND r.id = judged.id
        RETURNING p_i, 'applied'::text, false,
                  r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
                  r.output::text, r.external_output_url, r.started_at,
                  r.completed_at, r.lease_expires_at, r.error_code,
                  r.error_message, r.created_at, r.updated_at, r.updated_by;
    ELSIF judged.id IS NOT NULL THEN
        IF judged.outcome = 'stale_attempt' AND p_kind IN ('complete', 'fail') THEN
            -- 3. A late report: the attempt's entry, its times (the report's own completed_at,
            --    else the later of the clock and the start known; its own started_at, else the
            --    entry's, else its completed_at), and the entry written when it is missing or
            --    superseded and the times are in order. A terminal entry never changes (the
            --    upsert's WHERE decides on the entry's newest version).
            SELECT h.status, h.started_at, h.output, h.external_output_url, h.error_code,
                   h.error_message
            INTO v_entry
            FROM workflow_step_attempt h
            WHERE h.instance_id = v_id AND h.record_id = judged.id
              AND h.attempt = judged.new_attempt;
            v_completed_at := judge_event_completed_at(
                p_kind, p_completed_at, v_now, COALESCE(p_started_at, v_entry.started_at));
            v_started_at := COALESCE(p_started_at, v_entry.started_at, v_completed_at);
            IF (v_entry.status IS NULL OR v_entry.status IN ('running', 'superseded'))
               AND v_started_at <= v_completed_at THEN
                PERFORM set_config('steprecord.writer', 'judge', true);
                INSERT INTO workflow_step_attempt AS a (
                    id, instance_id, record_id, attempt, status, started_at, completed_at,
                    output, external_output_url, error_code, error_message, created_at,
                    updated_at, reported_by)
                OVERRIDING SYSTEM VALUE
                VALUES (nextval('workflow_step_attempt_id_seq'), v_id, judged.id,
                        judged.new_attempt, v_status, v_started_at, v_completed_at,
                        p_output::jsonb, p_external_output_url, p_error_code, p_error_message,
                        v_now, v_now, p_reported_by)
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
                RETURNING true INTO v_recorded;
                PERFORM set_config('steprecord.writer', coalesce(v_writer, ''), true);
            END IF;
            -- Recorded: written now, or the entry already holds this very report.
            v_recorded := coalesce(v_recorded, false) OR coalesce(judge_same_report(
                v_entry.status, v_entry.output, v_entry.external_output_url,
                v_entry.error_code, v_entry.error_message,
                v_status, p_output::jsonb, p_external_output_url, p_error_code,
                p_error_message), false);
        END IF;
        -- 4. (and 3) Judged without a write of the record: the record as it stands.
        v_outcome := judged.outcome;
        RETURN QUERY SELECT p_i, judged.outcome, v_recorded,
            judged.id, judged.step_slug, judged.ordinal, judged.status, judged.attempt_count,
            judged.output, judged.external_output_url, judged.started_at,
            judged.completed_at, judged.lease_expires_at, judged.error_code,
            judged.error_message, judged.created_at, judged.updated_at, judged.updated_by;
    ELSIF v_locked THEN
        -- 5. A new record, under its instance's lock: the client's ordinal, or the
        --    instance's next one (and the counter after it: past the client's, or one more).
        v_ordinal := COALESCE(p_ordinal, v_next);
        IF v_ordinal > 2147483647 THEN
            RETURN QUERY SELECT p_i, 'ordinal_taken'::text, false,
                NULL::bigint, NULL::text, NULL::int, NULL::text, NULL::int, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                NULL::timestamptz, NULL::timestamptz, NULL::text;
        ELSE
            UPDATE process_instance p
            SET next_ordinal = CASE WHEN p_ordinal IS NULL THEN v_next + 1
                                    ELSE GREATEST(v_next, p_ordinal + 1) END
            WHERE p.id = v_id;
            -- A declare creates attempt 1, pending; a start or a terminal event creates its
            -- own attempt (the one it names, else 1). A client ordinal that another step
            -- holds fails uq_workflow_step_record_instance_id_ordinal.
            v_outcome := 'created';
            RETURN QUERY
            INSERT INTO workflow_step_record AS r (
                id, instance_id, step_slug, ordinal, status, attempt_count, output,
                external_output_url, started_at, completed_at, error_code, error_message,
                lease_expires_at, created_at, updated_at, updated_by)
            OVERRIDING SYSTEM VALUE
            VALUES (nextval('workflow_step_record_id_seq'), v_id, p_step_slug, v_ordinal,
                    v_status, judge_event_attempt(p_kind, p_attempt, 1, 'pending'),
                    p_output::jsonb, p_external_output_url,
                    CASE WHEN p_kind <> 'declare' THEN COALESCE(p_started_at, v_now) END,
                    judge_event_completed_at(p_kind, p_completed_at, v_now, p_started_at),
                    p_error_code, p_error_message, judge_lease_expires_at(v_now, p_lease_seconds),
                    v_now, v_now, p_reported_by)
            RETURNING p_i, 'created'::text, false,
                      r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
                      r.output::text, r.external_output_url, r.started_at,
                      r.completed_at, r.lease_expires_at, r.error_code,
                      r.error_message, r.created_at, r.updated_at, r.updated_by;
        END IF;
    END IF;

    -- 6. The labels of an event answered 2xx, merged into its instance's when they change
    --    something (decided on the row's newest version: the UPDATE waits for its lock).
    IF p_labels IS NOT NULL AND v_outcome IN ('created', 'applied', 'replay') THEN
        UPDATE process_instance p SET labels = p.labels || p_labels
        WHERE p.id = v_id AND NOT p.labels @> p_labels;
    END IF;
    PERFORM set_config('steprecord.trace_id', coalesce(v_trace, ''), true);
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_apply_event FROM PUBLIC;

-- ===== app/sql/apply_events.sql =====
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

-- ===== app/sql/attempt_history.sql =====
-- The attempt history (workflow_step_attempt): one row per attempt of a record, written by
-- the database itself in the same statement as the record, whoever writes the record.
--
-- Three functions, three triggers:
--   * workflow_step_record_history_insert / _update (row triggers, AFTER each inserted or
--     updated row of workflow_step_record): every write to a record — the judge, a batch,
--     the sweeper, a hand-written UPDATE — brings its history up to date. On Citus a trigger
--     runs on the shard, and writes the history's row on the shard beside its record's
--     (co-located by instance_id: every statement below names the instance id as a value,
--     so Citus routes it to that one shard). The entry's id is taken from its sequence
--     before the upsert and passed as a value: Citus keeps the plan of a statement routed to
--     one shard of its own node (planned once per connection and shard) only when the
--     statement holds no volatile function, such as the identity's default;
--   * workflow_step_attempt_guard (row trigger on workflow_step_attempt): the history is
--     written only by those triggers, and a finished attempt never changes.

-- After a record is inserted: its attempt, unless it is pending (a pending record has no
-- attempt yet: the trigger's WHEN skips it). _update below repeats this upsert word for word,
-- and tests/test_sql_source.py holds the two equal: a shared function that both called would
-- add a PL/pgSQL call per row written, and one function serving both triggers would be a new
-- function, which a revision can install only by dropping both triggers first (DROP TRIGGER
-- locks the records ACCESS EXCLUSIVE, reads too, until the migration commits; CREATE OR
-- REPLACE TRIGGER, SHARE ROW EXCLUSIVE). An attempt row exists from the moment its attempt
-- starts and is brought up to date by every write of its record; the WHERE skips writes that
-- change nothing the history shows. A running attempt mirrors the record's lease; a
-- finished one keeps the last lease it held.
-- An entry written names its record's writer (reported_by = the record's updated_by):
-- whoever last wrote the record last wrote the entry.
CREATE OR REPLACE FUNCTION workflow_step_record_history_insert() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    v_id := nextval('workflow_step_attempt_id_seq');
    INSERT INTO workflow_step_attempt AS a (
        id, instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at, reported_by)
    OVERRIDING SYSTEM VALUE
    VALUES (v_id, NEW.instance_id, NEW.id, NEW.attempt_count, NEW.status, NEW.started_at,
            NEW.completed_at, NEW.output, NEW.external_output_url, NEW.error_code,
            NEW.error_message, NEW.lease_expires_at, NEW.updated_at, NEW.updated_at,
            NEW.updated_by)
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
        updated_at = EXCLUDED.updated_at,
        reported_by = EXCLUDED.reported_by
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

-- After a record is updated: first, a running attempt overtaken by a higher attempt
-- becomes `superseded` (it started and never reported an end; completed_at = when the next
-- attempt took over, never before its own start). The superseded entry names the writer of
-- the record's update that took it over, its last writer. Then the record's current attempt,
-- unless the record is pending, is inserted or brought up to date, as after an insert.
CREATE OR REPLACE FUNCTION workflow_step_record_history_update() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v_id bigint;
BEGIN
    IF OLD.status = 'running' AND NEW.attempt_count > OLD.attempt_count THEN
        UPDATE workflow_step_attempt a SET
            status = 'superseded',
            completed_at = GREATEST(a.started_at, COALESCE(NEW.started_at, NEW.updated_at)),
            updated_at = NEW.updated_at,
            reported_by = NEW.updated_by
        WHERE a.instance_id = OLD.instance_id AND a.record_id = OLD.id
          AND a.attempt = OLD.attempt_count AND a.status = 'running';
    END IF;
    IF NEW.status = 'pending' THEN
        RETURN NULL;
    END IF;
    v_id := nextval('workflow_step_attempt_id_seq');
    INSERT INTO workflow_step_attempt AS a (
        id, instance_id, record_id, attempt, status, started_at, completed_at, output,
        external_output_url, error_code, error_message, lease_expires_at,
        created_at, updated_at, reported_by)
    OVERRIDING SYSTEM VALUE
    VALUES (v_id, NEW.instance_id, NEW.id, NEW.attempt_count, NEW.status, NEW.started_at,
            NEW.completed_at, NEW.output, NEW.external_output_url, NEW.error_code,
            NEW.error_message, NEW.lease_expires_at, NEW.updated_at, NEW.updated_at,
            NEW.updated_by)
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
        updated_at = EXCLUDED.updated_at,
        reported_by = EXCLUDED.reported_by
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
FOR EACH ROW WHEN (NEW.status <> 'pending')
EXECUTE FUNCTION workflow_step_record_history_insert();

CREATE OR REPLACE TRIGGER tr_workflow_step_record_history_update
AFTER UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_history_update();

-- The history's guard, so that it cannot disagree with the record:
--   * it is written only by the record's triggers (trigger depth 2 and more): a
--     hand-written INSERT, UPDATE or DELETE of the history is refused (deleting a record's
--     instance still cascades: the cascade runs as a trigger too);
--   * one exception, the judge's late report of an older attempt (apply_events.sql, its
--     `late` steps), written while the judge runs (steprecord.writer = 'judge', set by
--     the judge's functions for the rest of their transaction): it may insert an attempt's terminal
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
        AND steprecord_by_owner()
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
        ELSE
            -- The record, one table by its distribution column and no subquery: on Citus a
            -- "fast path" statement, which the judge's generic plans can route.
            PERFORM FROM workflow_step_record r
            WHERE r.instance_id = NEW.instance_id AND r.id = NEW.record_id
              AND r.attempt_count > NEW.attempt;
            IF NOT FOUND THEN
                why := 'a late report is of an attempt older than its record''s';
            END IF;
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
        -- The guard's name in the message too, as a CHECK's: Citus relays a worker's
        -- SQLSTATE and message, not the constraint field.
        RAISE EXCEPTION 'workflow_step_attempt violates constraint "%": %',
                        'tr_workflow_step_attempt_guard', why
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

-- ===== app/sql/deletion.sql =====
-- Deleting instances (app/data/retention.py): one on request (`DELETE /v1/instances/{key}`),
-- or those last written before a cutoff (`steprecord prune`, STEPRECORD_RETENTION). Definer
-- functions (owner_rights.sql): the service's role deletes nothing itself. An instance goes
-- with its records in one statement; their history and repair log follow by ON DELETE
-- CASCADE.
--
-- Lock, then judge: two statements, the second of which takes its snapshot after the first's
-- lock was granted (at READ COMMITTED each statement of a VOLATILE function, as these are,
-- takes a new one), so it sees every step committed before, also one created by a writer
-- that held the instance's lock while the first waited (one statement that locked and judged
-- would judge on its own older snapshot, miss that step, and then fail on it, or delete it
-- unjudged). The second locks the
-- records too, in id order (a writer updating one finishes first, and the check of what is
-- running reads the newest versions). On Citus every statement names the instance's id, so it
-- runs on the one worker that holds the instance; distribution makes these functions plan each
-- statement with its values (app/ops/distribution.py), so Citus sees that id.

-- One instance, by its id and key: `present` false when there is no such instance; otherwise
-- its running steps and its repairs when it was judged, and `deleted` 1 when it went. Without
-- p_force an instance with a running step stays; without p_erase_repairs one whose repair log
-- holds entries stays.
CREATE OR REPLACE FUNCTION steprecord_delete_instance(
    p_instance_id bigint, p_instance_key text, p_force boolean, p_erase_repairs boolean
) RETURNS TABLE (present boolean, running bigint, repairs bigint, deleted bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    PERFORM FROM process_instance p
    WHERE p.id = p_instance_id AND p.instance_key = p_instance_key
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::bigint, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    RETURN QUERY
    WITH records AS (
        SELECT r.status FROM workflow_step_record r WHERE r.instance_id = p_instance_id
        ORDER BY r.id
        FOR UPDATE OF r
    ),
    logged AS (
        SELECT count(*) AS n FROM workflow_step_repair x WHERE x.instance_id = p_instance_id
    ),
    allowed AS (
        SELECT WHERE (p_force OR NOT EXISTS (SELECT 1 FROM records WHERE status = 'running'))
                 AND (p_erase_repairs OR (SELECT n FROM logged) = 0)
    ),
    gone_records AS (
        DELETE FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id AND EXISTS (SELECT FROM allowed)
    ),
    gone AS (
        DELETE FROM process_instance p
        WHERE p.id = p_instance_id AND EXISTS (SELECT FROM allowed) RETURNING p.id
    )
    SELECT true,
           (SELECT count(*) FROM records WHERE status = 'running'),
           (SELECT n FROM logged),
           (SELECT count(*) FROM gone);
END
$fn$;

-- Pruning, a batch of instances in one transaction (app/data/retention.py, `lock_due`):
-- first every instance of the batch is locked (steprecord_prune_lock, in id order), then each
-- is judged (steprecord_prune_due, after all the locks were granted) and the archive read,
-- then the instances that go are deleted (steprecord_prune_delete).

-- Lock one instance (a writer creating a step of it waits from then on).
CREATE OR REPLACE FUNCTION steprecord_prune_lock(p_instance_id bigint) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    PERFORM FROM process_instance p WHERE p.id = p_instance_id FOR UPDATE;
END
$fn$;

-- Judge one locked instance, locking its records in id order: a row when it goes, with what
-- goes with it. It goes when its last write (its records' greatest updated_at, else its own
-- created_at) is before p_cutoff and, unless p_include_unfinished, none of its records is
-- pending or running; so an instance written after the cutoff stays, even when it was
-- selected as a candidate before that write.
CREATE OR REPLACE FUNCTION steprecord_prune_due(
    p_instance_id bigint, p_cutoff timestamptz, p_include_unfinished boolean
) RETURNS TABLE (
    id bigint, instance_key text, created_at timestamptz, records bigint, attempts bigint
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    RETURN QUERY
    WITH locked AS (
        SELECT r.updated_at, r.status FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id
        ORDER BY r.id
        FOR UPDATE
    )
    SELECT p.id, p.instance_key, p.created_at,
           (SELECT count(*) FROM locked),
           (SELECT count(*) FROM workflow_step_attempt a WHERE a.instance_id = p_instance_id)
    FROM process_instance p
    WHERE p.id = p_instance_id
      AND COALESCE((SELECT max(l.updated_at) FROM locked l), p.created_at) < p_cutoff
      AND (p_include_unfinished
           OR NOT EXISTS (SELECT 1 FROM locked l WHERE l.status IN ('pending', 'running')));
END
$fn$;

-- Delete the judged instances of the batch with their records.
CREATE OR REPLACE FUNCTION steprecord_prune_delete(p_ids bigint[]) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
BEGIN
    WITH gone_records AS (
        DELETE FROM workflow_step_record r WHERE r.instance_id = ANY (p_ids)
    )
    DELETE FROM process_instance p WHERE p.id = ANY (p_ids);
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_delete_instance FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_prune_lock FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_prune_due FROM PUBLIC;
REVOKE ALL ON FUNCTION steprecord_prune_delete FROM PUBLIC;

-- ===== app/sql/list_page.sql =====
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

-- ===== app/sql/live_updates.sql =====
-- Live updates: what the stream (GET /v1/instances/{key}/stream) reads and listens to.
--
-- A change's position is (changed_xid, id) of the record it left: the stream sends every
-- record written by a transaction below its horizon, in that order, and resumes after a
-- reconnect exactly there. There is no change-log table.

-- Every write of a record stamps it with the writing transaction's id, whoever writes (the
-- judge, a batch, a heartbeat, the sweeper, a hand-written UPDATE; a value written by hand
-- is overwritten), so no writer can forget it or forge it.
CREATE OR REPLACE FUNCTION workflow_step_record_set_changed_xid() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    NEW.changed_xid := pg_current_xact_id();
    RETURN NEW;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_changed_xid
BEFORE INSERT OR UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_set_changed_xid();

-- One notification per record written, with the instance's id as payload. PostgreSQL
-- delivers it only when the transaction commits (never for a rollback) and drops duplicates
-- within a transaction, so listeners hear each committed write once per instance; a replay
-- or a refused event writes nothing and so notifies nothing. On Citus the trigger runs on
-- the worker's shard, and the notification comes from that worker (the service listens on
-- every worker; see app/live.py).
CREATE OR REPLACE FUNCTION workflow_step_record_notify() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('steprecord_changes', NEW.instance_id::text);
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER tr_workflow_step_record_notify_insert
AFTER INSERT ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_notify();

CREATE OR REPLACE TRIGGER tr_workflow_step_record_notify_update
AFTER UPDATE ON workflow_step_record
FOR EACH ROW EXECUTE FUNCTION workflow_step_record_notify();

-- A stream's read (app/data/stream.py): the records of an instance after a position
-- `(changed_xid, id)`, in that order, but only those written by transactions below the
-- horizon, before which every transaction that could write this database has ended, so no
-- record can still appear there later. On the primary the horizon is the oldest transaction
-- still running at this call's snapshot, skipping those that the activity view shows working
-- in another database (a cluster's other databases never write here; one that already ended
-- by the time the view is read counts as ours, to be safe), or the snapshot's xmax when none
-- is left. The activity view is read only when some transaction is running, and then once.
-- On a standby the snapshot lists no running transaction (in recovery PostgreSQL keeps the
-- primary's transactions among the snapshot's subtransactions) and the activity view knows
-- none of them, but the snapshot's xmin is the oldest of them still running as far as replay
-- got: the horizon there, other databases' transactions included.
--
-- `behind` says whether a visible record beyond the position, at or above the horizon, waits
-- for an older transaction still in flight. An unknown instance still yields one row (without
-- an instance id), which says whether a standby answered. `since` is the position the read
-- started from: the caller's, or (0, 0) when the caller's is beyond anything this server has
-- assigned (above its next transaction id: a position from another server, e.g. before the
-- instance's shard moved to another Citus worker), so the stream sends the whole instance
-- again rather than wait for this server's ids to get there. A standby may lag behind a
-- position the primary gave: it never resets.
--
-- At most p_limit records, and no more once the records answered hold p_max_bytes of long
-- values (output as text, error message, output URL) or more: `cut` is true on the last row
-- when the read stopped there for its bytes, and the stream reads on from that record. The
-- rows are read one by one and counted as they come, so a stream's first read of an instance
-- of large outputs stops reading at the bound.
--
-- PL/pgSQL, with the instance's id first: on Citus it is a distributed function by that
-- argument, so the whole call runs on the worker that holds the instance, and the snapshot,
-- the transaction ids and the activity view are that worker's, the ones the records'
-- `changed_xid` stamps come from.
CREATE OR REPLACE FUNCTION steprecord_stream_changes(
    p_instance_id bigint, p_instance_key text, p_after_xid xid8, p_after_id bigint,
    p_limit integer, p_max_bytes bigint
)
RETURNS TABLE (
    standby boolean, instance_id bigint, horizon xid8, since_xid xid8, since_id bigint,
    behind boolean, changed_xid xid8,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text, cut boolean
)
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_custom_plan
AS $fn$
#variable_conflict use_column
DECLARE
    v_snapshot pg_snapshot := pg_current_snapshot();
    v_standby boolean := pg_is_in_recovery();
    v_horizon xid8;
    v_after_xid xid8 := p_after_xid;
    v_after_id bigint := p_after_id;
    v_bytes bigint := 0;
BEGIN
    IF v_standby THEN
        v_horizon := pg_snapshot_xmin(v_snapshot);
    ELSE
        v_horizon := least(pg_snapshot_xmax(v_snapshot), (
            SELECT x FROM pg_snapshot_xip(v_snapshot) AS x
            WHERE x::xid NOT IN (
                SELECT a.backend_xid FROM pg_stat_activity a
                WHERE a.backend_xid IS NOT NULL AND a.datname <> current_database())
            ORDER BY x LIMIT 1));
        IF v_after_xid > pg_snapshot_xmax(v_snapshot) THEN
            v_after_xid := '0'::xid8;
            v_after_id := 0;
        END IF;
    END IF;
    cut := false;
    FOR standby, instance_id, horizon, since_xid, since_id, behind, changed_xid, id, step_slug,
        ordinal, status, attempt_count, output, external_output_url, started_at, completed_at,
        lease_expires_at, error_code, error_message, created_at, updated_at, updated_by IN
    SELECT v_standby, p.id, v_horizon, v_after_xid, v_after_id,
           EXISTS (SELECT FROM workflow_step_record l
                   WHERE l.instance_id = p_instance_id AND l.changed_xid >= v_horizon
                     AND (l.changed_xid, l.id) > (v_after_xid, v_after_id)),
           s.changed_xid,
           s.id, s.step_slug, s.ordinal, s.status, s.attempt_count, s.output,
           s.external_output_url, s.started_at, s.completed_at, s.lease_expires_at,
           s.error_code, s.error_message, s.created_at, s.updated_at, s.updated_by
    FROM (SELECT) one
    LEFT JOIN process_instance p
        ON p.id = p_instance_id AND p.instance_key = p_instance_key
    LEFT JOIN LATERAL (
        SELECT r.changed_xid, r.id, r.step_slug, r.ordinal, r.status, r.attempt_count,
               r.output::text AS output, r.external_output_url, r.started_at,
               r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
               r.created_at, r.updated_at, r.updated_by
        FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id AND p.id IS NOT NULL
          AND (r.changed_xid, r.id) > (v_after_xid, v_after_id)
          AND r.changed_xid < v_horizon
        ORDER BY r.changed_xid, r.id
        LIMIT p_limit
    ) s ON true
    LOOP
        v_bytes := v_bytes + coalesce(octet_length(output), 0)
            + coalesce(octet_length(error_message), 0)
            + coalesce(octet_length(external_output_url), 0);
        cut := v_bytes >= p_max_bytes;
        RETURN NEXT;
        EXIT WHEN cut;
    END LOOP;
END
$fn$;

-- ===== app/sql/reopen.sql =====
-- steprecord_reopen: an operator's repair (POST .../steps/{step_slug}/reopen, `steprecord
-- repair reopen`): a finished record becomes pending at the next attempt, and the repair log
-- (workflow_step_repair, repair_log.sql) keeps who did it and why. One call is one event,
-- judged and written under the record's row lock, as the judge's own functions do.
--
-- Arguments: p_instance_id, the instance's id (steprecord_instance_id(p_instance_key): the
-- service's statement computes it so; on Citus it is the function's distribution argument,
-- and every statement below names it as a value, so the whole call runs on the worker that
-- holds the instance); the instance's key; the step's slug; p_attempt, the attempt the
-- operator saw (NULL: whichever is current); the reason (1-500 characters, held by
-- ck_workflow_step_repair_reason_length); p_by, who asks (the token's name, `anonymous`, or
-- the CLI's writer name): the repair log's repaired_by, and the reopened record's updated_by
-- (its last writer), as every judge's write names its writer.
--
-- Answer: one row, `outcome` and the record as it stands after the call, plus the repair
-- log entry (repair_id, repair_at) when one was written. Outcomes:
--   * instance_not_found, step_not_found: no record (the record's columns are NULL);
--   * stale_attempt: p_attempt is not the record's attempt_count (another operator, or a
--     new attempt, came first): nothing written;
--   * not_finished: the record is pending or running, nothing to reopen;
--   * no_attempt_left: the record is at the last attempt there is (2147483647);
--   * reopened: the record is pending at attempt_count + 1, its times, output, error and
--     lease cleared, and one repair log entry was written.
-- The history is left to the record's triggers (attempt_history.sql): a pending record has
-- no attempt, so attempt N's entry stays as it was, and the next start runs attempt N+1.
--
-- steprecord.writer = 'repair' for the call's two writes only, set by set_config and then
-- restored (not by a `SET` clause of the function: see apply_events.sql): the record's guard
-- (record_guard.sql) lets a finished record go back to pending at the next attempt, and the
-- repair log's guard lets a row in, only then.
CREATE OR REPLACE FUNCTION steprecord_reopen(
    p_instance_id bigint, p_instance_key text, p_step_slug text, p_attempt int,
    p_reason text, p_by text
) RETURNS TABLE (
    outcome text,
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    lease_expires_at timestamptz, error_code text, error_message text,
    created_at timestamptz, updated_at timestamptz, updated_by text,
    repair_id bigint, repair_at timestamptz
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    -- The call's clock reading, a value: Citus refuses a VOLATILE function (clock_timestamp)
    -- in an UPDATE of a distributed table, and any but an IMMUTABLE one in an upsert's DO
    -- UPDATE SET, so the statements below never call a clock.
    v_now timestamptz := clock_timestamp();
    v_outcome text;
    -- The record as it stands (a `record`, not workflow_step_record%ROWTYPE: on Citus the
    -- function is made on the workers before the tables are, and a row type would not resolve).
    r record;
    v_repair_id bigint;
    -- The writer before this call, restored after its two writes.
    v_writer text := current_setting('steprecord.writer', true);
BEGIN
    -- The record, locked: a concurrent event or reopen of it waits until this call's
    -- transaction ends, and then judges the record this call left.
    SELECT rec.* INTO r
    FROM process_instance p
    JOIN workflow_step_record rec ON rec.instance_id = p.id AND rec.step_slug = p_step_slug
    WHERE p.id = p_instance_id AND p.instance_key = p_instance_key
    FOR UPDATE OF rec;

    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM process_instance p
                   WHERE p.id = p_instance_id AND p.instance_key = p_instance_key) THEN
            v_outcome := 'step_not_found';
        ELSE
            v_outcome := 'instance_not_found';
        END IF;
        RETURN QUERY SELECT v_outcome, NULL::bigint, NULL::text, NULL::int, NULL::text,
            NULL::int, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz,
            NULL::timestamptz, NULL::text, NULL::text, NULL::timestamptz, NULL::timestamptz,
            NULL::text, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;

    -- A named attempt first: an operator who saw attempt N finished and asks to reopen it
    -- learns that another one is current, even when that one is pending or running.
    IF p_attempt IS NOT NULL AND p_attempt <> r.attempt_count THEN
        v_outcome := 'stale_attempt';
    ELSIF r.status NOT IN ('completed', 'failed') THEN
        v_outcome := 'not_finished';
    ELSIF r.attempt_count >= 2147483647 THEN
        v_outcome := 'no_attempt_left';
    END IF;
    IF v_outcome IS NOT NULL THEN
        RETURN QUERY SELECT v_outcome, r.id, r.step_slug, r.ordinal, r.status,
            r.attempt_count, r.output::text, r.external_output_url, r.started_at,
            r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
            r.created_at, r.updated_at, r.updated_by, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;

    PERFORM set_config('steprecord.writer', 'repair', true);
    UPDATE workflow_step_record rec SET
        status = 'pending',
        attempt_count = r.attempt_count + 1,
        started_at = NULL,
        completed_at = NULL,
        output = NULL,
        external_output_url = NULL,
        error_code = NULL,
        error_message = NULL,
        lease_expires_at = NULL,
        updated_at = v_now,
        updated_by = p_by
    WHERE rec.instance_id = p_instance_id AND rec.id = r.id
    RETURNING rec.* INTO r;

    INSERT INTO workflow_step_repair AS rep (
        instance_id, record_id, step_slug, action, attempt, reason, repaired_by, at)
    VALUES (p_instance_id, r.id, r.step_slug, 'reopen', r.attempt_count - 1, p_reason, p_by,
            v_now)
    RETURNING rep.id INTO v_repair_id;
    PERFORM set_config('steprecord.writer', coalesce(v_writer, ''), true);

    RETURN QUERY SELECT 'reopened'::text, r.id, r.step_slug, r.ordinal, r.status,
        r.attempt_count, r.output::text, r.external_output_url, r.started_at,
        r.completed_at, r.lease_expires_at, r.error_code, r.error_message,
        r.created_at, r.updated_at, r.updated_by, v_repair_id, v_now;
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_reopen FROM PUBLIC;

-- ===== app/sql/sweeper.sql =====
-- The sweeper's write (app/ops/sweeper.py, app/data/leases.py): fail each running attempt of one
-- instance whose lease expired, as a `fail` event of that attempt would (error
-- `lease_expired`, completed_at = the expiry), in one statement; the number of records it
-- failed. A definer function (owner_rights.sql): the service's role writes no record itself.
--
-- One instance's rows live together (on Citus, on one worker: p_instance_id is the
-- distribution argument, so the coordinator sends the whole call there), so the statement
-- writes one node: a transaction that wrote two Citus workers would commit in two phases,
-- which PostgreSQL refuses to a transaction that notified, as every write of a record does.
-- SKIP LOCKED lets several sweepers (workers, service instances) run at once without ever
-- writing the same record twice, and FOR UPDATE re-checks the lease on the newest row
-- version, so a heartbeat that committed first keeps its attempt alive. The clock is the
-- statement's `now()`. The writer is `sweeper` (the record's updated_by, and the failed
-- attempt's reported_by).
CREATE OR REPLACE FUNCTION steprecord_sweep_instance(p_instance_id bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp
AS $fn$
DECLARE
    v_swept integer;
BEGIN
    WITH due AS (
        SELECT r.id FROM workflow_step_record r
        WHERE r.instance_id = p_instance_id AND r.status = 'running'
          AND r.lease_expires_at IS NOT NULL AND r.lease_expires_at < now()
        FOR UPDATE SKIP LOCKED
    ),
    swept AS (
        UPDATE workflow_step_record r SET
            status = 'failed',
            completed_at = GREATEST(r.lease_expires_at, r.started_at),
            error_code = 'lease_expired',
            error_message = 'no heartbeat, complete or fail arrived before the lease expired',
            lease_expires_at = NULL,
            updated_at = now(),
            updated_by = 'sweeper'
        FROM due
        WHERE r.instance_id = p_instance_id AND r.id = due.id
        RETURNING r.id
    )
    SELECT count(*) INTO v_swept FROM swept;
    RETURN v_swept;
END
$fn$;

-- Called by the owner and the roles it granted (owner_rights.sql).
REVOKE ALL ON FUNCTION steprecord_sweep_instance FROM PUBLIC;
