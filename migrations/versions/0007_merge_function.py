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

from pathlib import Path

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The frozen text this revision installs, beside this file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute("DROP FUNCTION steprecord_heartbeat(int[], text[], text[], bigint[], int[])")
    op.execute("""
        DROP FUNCTION steprecord_apply_events(
            int[], text[], text[], text[], bigint[], timestamptz[], timestamptz[], text[],
            text[], text[], text[], bigint[], int[]
        )
    """)
