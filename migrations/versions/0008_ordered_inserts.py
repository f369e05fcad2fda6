"""Create new instances and new records in key order, so concurrent batches cannot deadlock.

`steprecord_apply_events` (migration 0007) inserted the new instances of a set of events in
the order its grouping produced them, which differs from call to call. Two concurrent calls
that both create instances K1 and K2 could insert them in opposite orders: each then waits
for the other's uncommitted key, a deadlock that PostgreSQL detects only after
`deadlock_timeout` (1 s by default) and ends by aborting one of them. The benchmark's batch
load (16 connections, 100 events per call over 5,000 instances) hit four or five a run, each
costing a batch a second and a retry. PgBench's own batch statement inserts in key order
and never deadlocks.

Why each statement is here:

1. `CREATE OR REPLACE FUNCTION steprecord_apply_events(...)`: the same function, judging
   exactly as before, with two orders added: new instances are inserted by `instance_key`
   and new records by `(instance_id, step_slug)`. Any two calls then take the keys they
   both insert in the same order, so one waits for the other instead of deadlocking.
   Existing rows were already locked in id order (`ORDER BY ... FOR UPDATE`).

Downgrade restores the function of revision 0007 (its own definition, run again).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

RECORD = (
    "{r}.id, {r}.step_slug, {r}.ordinal, {r}.status, {r}.attempt_count,"
    " {r}.output::text AS output, {r}.external_output_url, {r}.started_at, {r}.completed_at,"
    " {r}.error_code, {r}.error_message, {r}.created_at, {r}.updated_at, {r}.lease_expires_at"
)
NO_RECORD = ", ".join(["NULL"] * 14)
RECORD_COLUMNS = """
    id bigint, step_slug text, ordinal integer, status text, attempt_count integer,
    output text, external_output_url text, started_at timestamptz, completed_at timestamptz,
    error_code text, error_message text, created_at timestamptz, updated_at timestamptz,
    lease_expires_at timestamptz
"""

# Positions: a record sits at (attempt_count, rank), rank pending 0, running 1, finished 2;
# an event at (attempt, k), k declare 0, start 1, complete/fail 2.
#
# A start's lease runs from the database clock; only a start carries `lease_seconds`, so every
# other event clears the lease.
#
# Server-assigned ordinals follow event order: with `s` the running count of server-assigned
# new steps of an instance and `a` the running max of (client ordinal + 1 - s), a
# server-assigned step gets s + max(base, a) - 1, which is what applying the events one by one
# would give, and the instance's counter ends at s_total + max(base, a_total).
APPLY_EVENTS = f"""
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
    SELECT e.i, 'created' AS outcome, {RECORD.format(r="ins")}
    FROM ins JOIN inst ON inst.id = ins.instance_id
    JOIN e ON e.instance_key = inst.instance_key AND e.step_slug = ins.step_slug
    UNION ALL
    SELECT upd.i, 'applied', {RECORD.format(r="upd")} FROM upd
    UNION ALL
    SELECT d.i, d.outcome, {RECORD.format(r="cur")} FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', {NO_RECORD} FROM e
    WHERE NOT e.can_create AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
    UNION ALL
    SELECT a.i, 'ordinal_taken', {NO_RECORD} FROM assigned a WHERE a.ordinal > 2147483647
"""


SIGNATURE = """
    int[], text[], text[], text[], bigint[], timestamptz[], timestamptz[], text[], text[],
    text[], text[], bigint[], int[]
"""


def upgrade() -> None:
    op.execute(f"""
        CREATE OR REPLACE FUNCTION steprecord_apply_events({SIGNATURE})
        RETURNS TABLE (i integer, outcome text, {RECORD_COLUMNS})
        LANGUAGE plpgsql
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            RETURN QUERY {APPLY_EVENTS};
        END
        $fn$
    """)


def downgrade() -> None:
    previous = _revision_0007()
    op.execute(f"DROP FUNCTION steprecord_apply_events({SIGNATURE})")
    op.execute(f"""
        CREATE FUNCTION steprecord_apply_events({SIGNATURE})
        RETURNS TABLE (i integer, outcome text, {previous.RECORD_COLUMNS})
        LANGUAGE plpgsql
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            RETURN QUERY {previous.APPLY_EVENTS};
        END
        $fn$
    """)


def _revision_0007() -> ModuleType:
    path = Path(__file__).with_name("0007_merge_function.py")
    spec = importlib.util.spec_from_file_location("steprecord_migration_0007", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
