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
   (their text, taken from revision 0008's statement, so the judging cannot drift) over the
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

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SIGNATURE = """
    int, text, text, text, bigint, timestamptz, timestamptz, text, text, text, text, bigint, int
"""
# The one event, as the general statement's `e` has its events; `{clock}` is its time.
EVENT = """
    WITH e AS MATERIALIZED (
        SELECT x.i, x.instance_key, x.step_slug, x.kind, x.attempt, x.started_at, x.completed_at,
               x.output::jsonb AS output, x.url, x.error_code, x.error_message, x.ordinal,
               {clock} + x.lease_seconds * interval '1 second' AS lease_expires_at,
               {clock} AS now,
               CASE x.kind WHEN 'declare' THEN 0 WHEN 'start' THEN 1 ELSE 2 END AS k,
               CASE x.kind WHEN 'declare' THEN 'pending' WHEN 'start' THEN 'running'
                           WHEN 'complete' THEN 'completed' ELSE 'failed' END AS target,
               (x.kind IN ('declare', 'start') OR x.started_at IS NOT NULL) AS can_create
        FROM (VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13))
            AS x(i, instance_key, step_slug, kind, attempt, started_at, completed_at, output, url,
                 error_code, error_message, ordinal, lease_seconds)
    ),"""
# Where the general statement's steps begin: finding and locking the record, judging the
# event, updating the record, and creating what does not exist yet.
KNOWN, DEC, UPD, FRESH = "\n    known AS (", "\n    dec AS (", "\n    upd AS (", "\n    fresh AS ("
# The general statement's answers for events whose record exists.
JUDGED_ANSWERS = """
    SELECT upd.i, 'applied', {upd} FROM upd
    UNION ALL
    SELECT d.i, d.outcome, {cur} FROM dec d JOIN cur ON cur.i = d.i
    WHERE d.outcome <> 'applied'
    UNION ALL"""


def _steps(general: str, record: str) -> tuple[str, str, str]:
    """From the general statement: its `known`, `cur` and `dec` steps; its `upd` step; and
    the statement without `dec`, `upd` and their answers (creation only), after `e`."""
    answers = JUDGED_ANSWERS.format(upd=record.format(r="upd"), cur=record.format(r="cur"))
    if any(general.count(marker) != 1 for marker in (KNOWN, DEC, UPD, FRESH, answers)):
        raise RuntimeError("revision 0008's merge does not read as expected")
    known, dec, upd, fresh = (general.index(marker) for marker in (KNOWN, DEC, UPD, FRESH))
    judge = general[known:upd].rstrip().rstrip(",")
    update = general[upd:fresh].rstrip().rstrip(",")
    create = (general[known:dec] + general[fresh:]).replace(answers, "")
    return judge, update, create


def body(general: str, record: str) -> str:
    """The function's body: judge under the row lock and update only what was applied, or
    create the record."""
    judge, update, create = _steps(general, record)
    return f"""
        DECLARE
            judged record;
        BEGIN
            {EVENT.format(clock="clock_timestamp()")}{judge}
            SELECT d.outcome, d.a_e, d.started_at AS judged_started_at, e.now,
                   {record.format(r="cur")}
            INTO judged
            FROM dec d JOIN cur ON cur.i = d.i JOIN e ON e.i = d.i;
            IF NOT FOUND THEN
                RETURN QUERY {EVENT.format(clock="clock_timestamp()")}{create};
            ELSIF judged.outcome = 'applied' THEN
                RETURN QUERY {EVENT.format(clock="judged.now")}
                dec AS (
                    SELECT $1 AS i, judged.id AS id, judged.a_e AS a_e,
                           judged.judged_started_at AS started_at, 'applied'::text AS outcome
                ),{update}
                SELECT upd.i, 'applied'::text, {record.format(r="upd")} FROM upd;
            ELSE
                RETURN QUERY SELECT $1, judged.outcome, {record.format(r="judged")};
            END IF;
        END
"""


def upgrade() -> None:
    first = _module("0007_merge_function.py")
    statement = first.APPLY_EVENTS
    for before, after in _module("0008_ordered_inserts.py").ORDERS:
        statement = statement.replace(before, after)
    op.execute(f"""
        CREATE FUNCTION steprecord_apply_event({SIGNATURE})
        RETURNS TABLE (i integer, outcome text, {first.RECORD_COLUMNS})
        LANGUAGE plpgsql
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        {body(statement, first.RECORD)}
        $fn$
    """)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION steprecord_apply_event({SIGNATURE})")


def _module(filename: str) -> ModuleType:
    path = Path(__file__).with_name(filename)
    spec = importlib.util.spec_from_file_location(f"steprecord_migration_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
