"""The judge on Citus: every event, batch and heartbeat runs on the worker of its instance.

On Citus the judge was refused beyond an existing record's common case:

- the history's triggers were statement triggers with transition tables, which a shard
  cannot find ("could not find named tuplestore"): they are row triggers now, with the same
  behaviour (the superseding of an overtaken running attempt, the upsert of the current one,
  the WHERE that skips writes that change nothing); the single-node cost is measured in
  tests/bench/README.md;
- the general statement (`steprecord_apply_events`: new records, batches, late reports)
  writes through INSERTs in its WITH, which Citus plans part by part, and then refuses its
  row locks across shards. `steprecord_apply_events_on_shard` (new) runs it on one shard
  group's own shards, on the worker that group lives on: the one-event judge's fallback
  calls it there, and the service sends a batch's events to it group by group. Its inserts
  now name the identity's next value (the shards have no identity of their own);
- the heartbeat's statement names its instances' ids, so a call for one shard group is
  routed to that group's worker, and computes the lease outside its UPDATE (Citus refuses a
  STABLE function over a column there);
- two rules of the judge were simple CASEs, which Citus sends to a shard with NULL::boolean
  for their WHENs: they compare with `=` now.

On one node the batch and single-event statements are the same statements with a condition
that repeats what the keys say; the new record of a single event goes through one more
function call.

Frozen in `0023_judge_on_citus.up.sql` by `python -m app.sql freeze 0023_judge_on_citus`;
the downgrade restores the previous text (`.down.sql`).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06
"""

from pathlib import Path

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# The frozen text this revision installs, and the text its downgrade restores, beside this
# file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")
DOWN = Path(__file__).with_suffix(".down.sql")


def upgrade() -> None:
    op.run_script(UP.read_text())


def downgrade() -> None:
    op.run_script(DOWN.read_text())
