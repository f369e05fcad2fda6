"""Put the page read in the database: `steprecord_list_steps`.

`GET /v1/instances/{key}/steps` sent one statement that reads a page of records and has
PostgreSQL render it as JSON. Unprepared (PgBouncer in transaction mode keeps no prepared
statements), it was planned on every call, and planning it cost more than running it: on
PostgreSQL 15, a page of 100 planned in about 1.3 ms and ran in about 1.3 ms. A PL/pgSQL
function's statements are planned once per server connection, through any pooler, so a read
now costs only the run (pgbench, 16 clients, the same page: 1,406 calls/s for the statement,
2,083 for the function, same bytes).

Why each statement is here:

1. `steprecord_list_steps(instance_key, order, after_ordinal, after_started_at, after_id,
   statuses, page_size, summary)`: one page of an instance's records in `order`
   (`ordinal`, or `started_at` then never-started records by id) after a keyset position,
   optionally only some statuses. It answers one row: `found` (0 when the instance does not
   exist), `items` (the page's records as JSON objects, comma-separated, exactly as the API
   renders them: timestamps in UTC with a `Z`, microseconds only when not zero; the stored
   output as PostgreSQL prints it), and the position of the page's last record when another
   page follows (`last_ordinal`, or `last_started_at` and `last_id`). A `started_at` position
   without a time (`after_started_at` NULL) is inside the never-started part, read alone.
   `summary` leaves out `output` and `error_message`. Each of the three reads is a range scan
   of one index (owner and ordinal, owner and start time, or two appended), whatever the
   parameters, so the one generic plan per connection is the plan a custom one would be.

Downgrade drops it; the service of the revision before sends its own statement.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from pathlib import Path

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

SIGNATURE = "text, text, integer, timestamptz, bigint, text[], integer, boolean"
# The frozen text this revision installs, beside this file and read by it alone.
UP = Path(__file__).with_suffix(".up.sql")


def upgrade() -> None:
    op.execute(UP.read_text())


def downgrade() -> None:
    op.execute(f"DROP FUNCTION steprecord_list_steps({SIGNATURE})")
