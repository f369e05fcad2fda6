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
--
-- A CASE here compares with `=` in each WHEN (CASE WHEN x = 'a' ...), never the simple form
-- (CASE x WHEN 'a' ...): Citus, evaluating the values of an inlined simple CASE before it
-- sends a statement to a shard, writes its WHENs as `NULL::boolean` and the shard refuses
-- the statement (operator does not exist: text = boolean).

-- A status's rank within its attempt: pending 0, running 1, finished (completed, failed) 2.
CREATE OR REPLACE FUNCTION judge_status_rank(p_status text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN p_status = 'pending' THEN 0 WHEN p_status = 'running' THEN 1 ELSE 2 END
$fn$;

-- The status an event of a kind leads to: declare pending, start running, complete
-- completed, fail failed.
CREATE OR REPLACE FUNCTION judge_event_status(p_kind text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$
    SELECT CASE WHEN p_kind = 'declare' THEN 'pending' WHEN p_kind = 'start' THEN 'running'
                WHEN p_kind = 'complete' THEN 'completed' ELSE 'failed' END
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
