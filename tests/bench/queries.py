"""The least SQL a page read needs, as plain statements: what pgbench runs beside the service.

The service reads pages through `steprecord_list_page` (`app/sql/list_page.sql`); these are
the same three reads as statements with named parameters, selecting the record's columns,
so that pgbench measures the database's own cost of a page, and the tests can compare the
function's binary rows with a plain statement's text rows.
"""

from app.data.common import RECORD

STATUS_FILTER = "AND (%(statuses)s::text[] IS NULL OR r.status = ANY(%(statuses)s::text[]))"


def _list_queries(columns: str) -> tuple[str, str, str]:
    """The three list queries (by ordinal, by started_at, inside the never-started part),
    each selecting `columns` of the records `r` of one page of an instance `p`."""
    started = f"""
    (SELECT {columns} FROM workflow_step_record r
     WHERE r.instance_id = p.id
       AND (r.started_at, r.id) > (%(after_started_at)s, %(after_id)s) {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT %(limit)s)
"""
    unstarted = f"""
    (SELECT {columns} FROM workflow_step_record r
     WHERE r.instance_id = p.id AND r.started_at IS NULL
       AND r.id > %(after_id)s {STATUS_FILTER}
     ORDER BY r.started_at, r.id
     LIMIT %(limit)s)
"""
    by_ordinal = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL (
    SELECT {columns} FROM workflow_step_record r
    WHERE r.instance_id = p.id AND r.ordinal > %(after_ordinal)s {STATUS_FILTER}
    ORDER BY r.ordinal
    LIMIT %(limit)s
) s ON true
WHERE p.instance_key = %(instance_key)s
"""
    # Started steps by (started_at, id), then never-started ones by id: two index range scans
    # appended, so neither needs a sort. A cursor inside the never-started part needs only
    # that one.
    by_started_at = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL (
    {started} UNION ALL {unstarted.replace("%(after_id)s", "0")} LIMIT %(limit)s
) s ON true
WHERE p.instance_key = %(instance_key)s
"""
    only_unstarted = f"""
SELECT p.id AS instance_id, s.*
FROM process_instance p
LEFT JOIN LATERAL {unstarted} s ON true
WHERE p.instance_key = %(instance_key)s
"""
    return by_ordinal, by_started_at, only_unstarted


LIST_BY_ORDINAL, LIST_BY_STARTED_AT, LIST_UNSTARTED = _list_queries(RECORD.format(r="r"))
