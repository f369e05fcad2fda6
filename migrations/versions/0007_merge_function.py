"""Put the event merge in the database: `steprecord_apply_events` and `steprecord_heartbeat`.

The merge statement (one statement per event or per set of events of distinct steps, 15 CTEs
that decide, lock, write and answer) cost about 1.5 ms to plan on every call and 0.7 ms to run:
PgBouncer in transaction mode cannot keep prepared statements, so it was planned every time.
A PL/pgSQL function's statements are prepared once per server connection and their plans
cached there, through any pooler; and `psql` or an orchestrator in any language can call the
same judge the service calls.

Why each statement is here:

1. `steprecord_apply_events(indexes, instance_keys, step_slugs, kinds, attempts, started_ats,
   completed_ats, outputs, external_output_urls, error_codes, error_messages, ordinals,
   lease_seconds)`: applies a set of events of distinct steps (a single event is a set of
   one), each judged as if alone and in array order, in one statement. It returns one row per
   event: its index, the outcome (`created`, `applied`, `replay`, `conflict`, `stale_attempt`,
   `not_started`, `ordinal_taken`) and the record after the event or as it stands (NULLs when
   there is none). An event with no row lost a race with a concurrent creator of its
   instance: calling again with it sees the new row. What the database refuses (a named
   constraint, a value out of range, a deadlock) is raised as by the statement alone.
   `plan_cache_mode = force_generic_plan`: the statement's plan does not depend on the
   arrays' contents (every access is by key), so one plan, made once per connection, serves
   every call; a custom plan would be made again, at the full planning cost, on every call.
2. `steprecord_heartbeat(indexes, instance_keys, step_slugs, attempts, lease_seconds)`: extends
   the lease of the running attempt each heartbeat names, under the record's row lock, and
   answers `applied`, `stale_attempt`, `not_started` or `not_running` the same way.

Downgrade drops both functions; the service of the revision before carries its own statement.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from alembic import op

revision = "0007"
down_revision = "0006"
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

HEARTBEAT = f"""
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
    SELECT upd.i, 'applied' AS outcome, {RECORD.format(r="upd")} FROM upd
    UNION ALL
    SELECT d.i, d.outcome, {RECORD.format(r="cur")} FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL
    SELECT e.i, 'not_started', {NO_RECORD} FROM e
    WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.i = e.i)
"""


def upgrade() -> None:
    op.execute(f"""
        CREATE FUNCTION steprecord_apply_events(
            int[], text[], text[], text[], bigint[], timestamptz[], timestamptz[], text[],
            text[], text[], text[], bigint[], int[]
        ) RETURNS TABLE (i integer, outcome text, {RECORD_COLUMNS})
        LANGUAGE plpgsql
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            RETURN QUERY {APPLY_EVENTS};
        END
        $fn$
    """)
    op.execute(f"""
        CREATE FUNCTION steprecord_heartbeat(int[], text[], text[], bigint[], int[])
        RETURNS TABLE (i integer, outcome text, {RECORD_COLUMNS})
        LANGUAGE plpgsql
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            RETURN QUERY {HEARTBEAT};
        END
        $fn$
    """)


def downgrade() -> None:
    op.execute("DROP FUNCTION steprecord_heartbeat(int[], text[], text[], bigint[], int[])")
    op.execute("""
        DROP FUNCTION steprecord_apply_events(
            int[], text[], text[], text[], bigint[], timestamptz[], timestamptz[], text[],
            text[], text[], text[], bigint[], int[]
        )
    """)
