"""The judge written once as a template, and on Citus a copy of it per shard: growth.

On Citus a replayed event cost the worker that holds its instance 2.2-2.45 times what it costs
one node (tests/bench/call_shapes.py): each of `steprecord_apply_event`'s statements on the
distributed tables goes through Citus's planner and executor, and Citus plans every call of
a distributed function with parameters anew. With four workers the cluster gave 1.71 times
one node, not the 2.5 the service is meant to reach (docs/scaling.md). A copy of the judge on
one shard's own tables, taking Citus's lock on the shard's metadata and checking the
placement first, 1.2-1.6 times: four workers then judge 2.73 times one node's replays
(tests/bench/growth.py, every node capped at 0.2 of a core).

1. `apply_event.sql`: the judge's text is a template (`steprecord_apply_event_text`, for
   format(), its placeholders the name's suffix, the three tables and statements run first),
   and `steprecord_apply_event` is made from it on the tables themselves: the same function,
   the same statements (the late report's upsert names its unique key by its columns, which
   a shard's table has too, where it had named the constraint).
2. `shard_judge.sql`: `steprecord_shard_judge(shard)` makes, on the Citus node it is called
   on, that shard's copy (when the node holds the shard) and answers its name; the service
   calls the copy for the instances it knows to be on that shard. Each call of a copy takes
   Citus's shard metadata lock and checks, under it, that the shard is on the node and the
   instance in the shard; else it is the distributed judge's call. `steprecord_drop_shard_
   judges()` drops a node's copies: `migrate` calls it on every node before it changes the
   schema (a copy names the answer type, which a revision may make again).
On one node nothing but 1. is used; the functions of 2. are there all the same.

Frozen in `0040_shard_judges.up.sql` by `python -m app.sql freeze 0040_shard_judges`;
the downgrade restores `apply_event.sql` as of 0039 and drops the new functions (`migrate`
has dropped the copies first).

Revision ID: 0040
Revises: 0039
Create Date: 2026-12-08
"""

from pathlib import Path

from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None

UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
