"""The page read answers records as rows; the service renders them.

`steprecord_list_steps` (revision 0009) rendered a page of records as JSON text inside
PostgreSQL, and building that text was most of its cost: run 2,000 times in one statement on
a table of 10^4 records (PostgreSQL 15, pages of 100), it took 830-1,090 us a page, against
about 120 us for the same rows without rendering; `row_to_json` of the 15 fields made about
half of the difference and `to_char` for the times the rest. The rows now travel in binary
and the service renders them with orjson: through the service, PostgreSQL's CPU per page read
fell from 887-1,037 us to 349-381 us, the workers' rose by less, and reads/s rose 17-29 %
(the README's Performance section has the figures).

Why each statement is here:

1. `steprecord_list_page(instance_key, order, after_ordinal, after_started_at, after_id,
   statuses, max_rows)`: up to `max_rows` records of an instance in `order` (`ordinal`, or
   `started_at` then never-started records by id) after a keyset position, optionally only
   some statuses; a `started_at` position without a time (`after_started_at` NULL) is inside
   the never-started part, read alone. Its columns are the record as the API shows it, in the
   API's order, with the instance's key and the output as text. No row: the instance does not
   exist; one row whose `id` is NULL: it has no such record. Each of the three reads is a
   range scan of one index under its `LIMIT` (as in revision 0009), so the one generic plan
   per connection is the plan a custom one would be.

It only adds: `steprecord_list_steps`, which this code no longer calls, stays for instances of
the previous release still serving during a rolling deploy (a later revision can drop it).
Downgrade drops the new function.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from pathlib import Path

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

SIGNATURE = "text, text, integer, timestamptz, bigint, text[], integer"
# The frozen text this revision installs, beside this file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute(f"DROP FUNCTION steprecord_list_page({SIGNATURE})")
