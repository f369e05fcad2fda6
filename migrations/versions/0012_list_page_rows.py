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

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

SIGNATURE = "text, text, integer, timestamptz, bigint, text[], integer"

COLUMNS = (
    "r.id, p.instance_key, r.step_slug, r.ordinal, r.status, r.attempt_count, r.output::text,"
    " r.external_output_url, r.started_at, r.completed_at, r.lease_expires_at, r.error_code,"
    " r.error_message, r.created_at, r.updated_at"
)
STATUS_FILTER = "AND (p_statuses IS NULL OR r.status = ANY(p_statuses))"

BY_ORDINAL = f"""
    SELECT {COLUMNS}
    FROM process_instance p
    LEFT JOIN LATERAL (
        SELECT * FROM workflow_step_record r
        WHERE r.instance_id = p.id AND r.ordinal > p_after_ordinal {STATUS_FILTER}
        ORDER BY r.ordinal
        LIMIT p_max_rows
    ) r ON true
    WHERE p.instance_key = p_instance_key
"""
STARTED = f"""
    (SELECT * FROM workflow_step_record r
     WHERE r.instance_id = p.id
       AND (r.started_at, r.id) > (p_after_started_at, p_after_id) {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT p_max_rows)
"""
UNSTARTED = f"""
    (SELECT * FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > {{after_id}} {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT p_max_rows)
"""
# Started steps by (started_at, id), then never-started ones by id: two index range scans
# appended, so neither needs a sort.
BY_STARTED_AT = f"""
    SELECT {COLUMNS}
    FROM process_instance p
    LEFT JOIN LATERAL (
        {STARTED} UNION ALL {UNSTARTED.format(after_id="0")} LIMIT p_max_rows
    ) r ON true
    WHERE p.instance_key = p_instance_key
"""
ONLY_UNSTARTED = f"""
    SELECT {COLUMNS}
    FROM process_instance p
    LEFT JOIN LATERAL {UNSTARTED.format(after_id="p_after_id")} r ON true
    WHERE p.instance_key = p_instance_key
"""


def upgrade() -> None:
    op.execute(f"""
        CREATE FUNCTION steprecord_list_page(
            p_instance_key text, p_order text, p_after_ordinal integer,
            p_after_started_at timestamptz, p_after_id bigint, p_statuses text[],
            p_max_rows integer
        ) RETURNS TABLE (
            id bigint, instance_key text, step_slug text, ordinal integer, status text,
            attempt_count integer, output text, external_output_url text,
            started_at timestamptz, completed_at timestamptz, lease_expires_at timestamptz,
            error_code text, error_message text, created_at timestamptz, updated_at timestamptz
        )
        LANGUAGE plpgsql STABLE
        SET plan_cache_mode = force_generic_plan
        AS $fn$
        #variable_conflict use_column
        BEGIN
            IF p_order = 'ordinal' THEN
                RETURN QUERY {BY_ORDINAL};
            ELSIF p_after_started_at IS NULL THEN
                RETURN QUERY {ONLY_UNSTARTED};
            ELSE
                RETURN QUERY {BY_STARTED_AT};
            END IF;
        END
        $fn$
    """)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION steprecord_list_page({SIGNATURE})")
