"""The record's shape is written once (app/core/record.py); everything that shows a record follows.

The database functions that answer records declare their columns in SQL, which cannot read
Python: these tests hold each answer (a `RETURNS TABLE`, or the composite type a function
returns a set of, as the judge's two return `steprecord_judged`) to the one definition,
column for column.
"""

import psycopg
import pytest

from app.api import spec as schemas
from app.core import record, serialize
from app.data.common import RECORD

Conn = psycopg.Connection[tuple[object, ...]]

# Each function that answers records: the columns before the record's, and whether the
# instance's key is among the record's (a page has it; the judge's caller adds it).
ANSWERS = {
    "steprecord_apply_event": (("i", "integer"), ("outcome", "text"), ("recorded", "boolean")),
    "steprecord_apply_events": (("i", "integer"), ("outcome", "text"), ("recorded", "boolean")),
    "steprecord_heartbeat": (("i", "integer"), ("outcome", "text")),
    "steprecord_list_page": (),
    "steprecord_reopen": (("outcome", "text"),),
    "steprecord_stream_changes": (
        ("standby", "boolean"),
        ("instance_id", "bigint"),
        ("horizon", "xid8"),
        ("since_xid", "xid8"),
        ("since_id", "bigint"),
        ("behind", "boolean"),
        ("changed_xid", "xid8"),
    ),
}
WITH_KEY = {"steprecord_list_page"}
# The columns after the record's: whether a read stopped at that row for its bytes.
AFTER = {
    "steprecord_list_page": (("cut", "boolean"),),
    "steprecord_reopen": (("repair_id", "bigint"), ("repair_at", "timestamp with time zone")),
    "steprecord_stream_changes": (("cut", "boolean"),),
}

# A function's answer columns: its `RETURNS TABLE`, or the attributes of the composite type
# it returns a set of.
RETURNS_TABLE = """
SELECT name, format_type(type, NULL) FROM (
    SELECT a.name, a.type, a.n
    FROM pg_proc p, unnest(p.proargnames, p.proallargtypes, p.proargmodes)
        WITH ORDINALITY AS a(name, type, mode, n)
    WHERE p.proname = %(function)s AND a.mode = 't'
    UNION ALL
    SELECT a.attname, a.atttypid, a.attnum
    FROM pg_proc p JOIN pg_type t ON t.oid = p.prorettype
    JOIN pg_class c ON c.oid = t.typrelid AND c.relkind = 'c'
    JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    WHERE p.proname = %(function)s AND p.proretset
) answer
ORDER BY n
"""


@pytest.mark.parametrize("function", sorted(ANSWERS))
def test_each_function_answers_the_record_s_columns_in_its_order_and_types(
    db: Conn, function: str
) -> None:
    def sql_type(name: str) -> str:
        row = db.execute("SELECT format_type(%s::regtype, NULL)", (name,)).fetchone()
        assert row is not None
        return str(row[0])

    fields = [f for f in record.FIELDS if f.stored or function in WITH_KEY]
    record_columns = ((f.key, sql_type(f.sql)) for f in fields)
    expected = [*ANSWERS[function], *record_columns, *AFTER.get(function, ())]
    declared = [
        (str(name), str(kind)) for name, kind in db.execute(RETURNS_TABLE, {"function": function})
    ]
    assert declared == expected


def test_the_response_model_the_json_keys_and_the_columns_follow_the_one_definition() -> None:
    assert tuple(schemas.Record.model_fields) == record.KEYS
    required = {key for key, field in schemas.Record.model_fields.items() if field.is_required()}
    assert required == set(record.KEYS) - set(record.NOT_IN_SUMMARY)
    assert serialize.RECORD_KEYS == record.KEYS
    columns = RECORD.format(r="r").split(", ")
    selected = [column.split(" AS ")[-1].removeprefix("r.") for column in columns]
    assert selected == [f.key for f in record.FIELDS if f.stored]
