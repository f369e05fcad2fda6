"""A cheaper statement for one event: `steprecord_apply_event`.

Every single event (`POST .../start`, `/complete`, `/fail`, `/declare`) went through
`steprecord_apply_events`, whose one statement holds everything any event may need: the
lookup and judging of existing records, their update, and for new records ordinals counted
with window functions, instances locked, created and bumped, records inserted. One event
needs one of the two halves, but the statement runs both, and its update fires the update
triggers even when nothing is written. pgbench, 8 clients, 4-5 s rounds on PostgreSQL 15:
replays of existing records 2,416-2,541 calls/s through `steprecord_apply_events`, starts
of new steps 1,152-1,540.

Why each statement is here:

1. `steprecord_apply_event(i, instance_key, step_slug, kind, attempt, started_at,
   completed_at, output, external_output_url, error_code, error_message, ordinal,
   lease_seconds)`: the same event as a one-element call of `steprecord_apply_events`, with
   scalars for arrays, answering the same row. It runs the general statement's own steps
   (their text as revision 0008's statement had it; frozen in the `.up.sql` file) over the
   one event, in at most two statements:
   - `known`, `cur` and `dec`: the record, if it exists, locked and the event judged;
   - when the event applies, `upd` writes it; any other outcome writes nothing;
   - when there is no record, the general statement without `dec` and `upd` creates it (or
     answers `not_started` or `ordinal_taken`). A record created concurrently in between is
     found there by `cur` and left alone; the event then has no answer row, as when it loses
     such a race in the general statement, and calling again judges it.
   Replays: 4,104-5,457 calls/s; starts of new steps: 1,656-1,662, against 1,189-1,386
   through `steprecord_apply_events` in the same rounds.

Downgrade drops it; the service of the revision before calls `steprecord_apply_events`.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from pathlib import Path

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The frozen text this revision installs, beside this file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute("""
        DROP FUNCTION steprecord_apply_event(
            int, text, text, text, bigint, timestamptz, timestamptz, text, text, text, text, bigint,
            int
        )
    """)
