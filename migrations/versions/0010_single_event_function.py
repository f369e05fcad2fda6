"""A cheaper statement for one event on an existing record: `steprecord_apply_event`.

Every single event (`POST .../start`, `/complete`, `/fail`, `/declare`) went through
`steprecord_apply_events`, whose one statement also holds everything a set of new records
needs: ordinals counted with window functions, instances locked, created and bumped, records
inserted. For one event on a record that already exists (a terminal event, a retry, a replay:
most events of a run) all of that runs empty but still costs its share. pgbench, 16 clients,
a start of a new step and the complete of an earlier one per run: 524-541 runs/s through
`steprecord_apply_events`; a function that reads, judges and updates an existing record with
scalar parameters did 721-783.

Why each statement is here:

1. `steprecord_apply_event(i, instance_key, step_slug, kind, attempt, started_at,
   completed_at, output, external_output_url, error_code, error_message, ordinal,
   lease_seconds)`: the same event as a one-element call of `steprecord_apply_events`, with
   scalars for arrays, answering the same row. It first runs the general statement's own
   `known`, `cur`, `dec` and `upd` steps (their text, taken from revision 0008's statement,
   so the judging cannot drift) over the one event: the record, if it exists, is locked,
   judged and updated as before. Only when there is no record does it call
   `steprecord_apply_events` with the event, which creates it or answers `not_started`; a
   record created concurrently in between is found by that call, as by any other.

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
KNOWN, UPD, FRESH = "\n    known AS (", "\n    upd AS (", "\n    fresh AS ("


def _steps(general: str) -> tuple[str, str]:
    """The general statement's `known`, `cur` and `dec` steps, and its `upd` step."""
    if any(general.count(marker) != 1 for marker in (KNOWN, UPD, FRESH)):
        raise RuntimeError("revision 0008's merge does not read as expected")
    judge = general[general.index(KNOWN) : general.index(UPD)]
    update = general[general.index(UPD) : general.index(FRESH)]
    return judge.rstrip().rstrip(","), update.rstrip().rstrip(",")


def body(general: str, record: str) -> str:
    """The function's body: judge under the row lock, update only what was applied."""
    judge, update = _steps(general)
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
                RETURN QUERY SELECT * FROM steprecord_apply_events(
                    ARRAY[$1], ARRAY[$2], ARRAY[$3], ARRAY[$4], ARRAY[$5], ARRAY[$6],
                    ARRAY[$7], ARRAY[$8], ARRAY[$9], ARRAY[$10], ARRAY[$11], ARRAY[$12],
                    ARRAY[$13]);
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
