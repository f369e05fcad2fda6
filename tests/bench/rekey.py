"""Revision 0036's rewrite: how long the upgrade that gives every instance its keyed id takes
(and its downgrade), by the size of the database.

Run from the repository root: `.venv-test/bin/python -m tests.bench.rekey [--instances N]`.
It creates a database on the server in `DATABASE_URL` (or an embedded PostgreSQL in a
temporary directory), migrates it to revision 0035, loads N instances (default 25,000) of three
records each (one completed, one running, one declared; the record's history trigger writes
their attempts), then times `upgrade 0036` and `downgrade 0035` and prints the database's size
before and after each, and after a `VACUUM (ANALYZE)`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from alembic import command  # noqa: E402

from app.main import alembic_config  # noqa: E402
from tests.bench.common import postgres_server  # noqa: E402
from tests.support.databases import create_database, drop_database  # noqa: E402

# As revision 0035 derives ids (the plain SHA-256), the rows a service would have written.
LOAD = (
    """
INSERT INTO process_instance (id, instance_key, next_ordinal)
SELECT steprecord_instance_id('rekey-' || i), 'rekey-' || i, 3
FROM generate_series(1, %(instances)s) AS i
""",
    """
INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                  started_at, completed_at, output, updated_by)
SELECT p.id, s.slug, s.ordinal, s.status, 1,
       CASE WHEN s.status <> 'pending' THEN now() - interval '1 minute' END,
       CASE WHEN s.status = 'completed' THEN now() END,
       CASE WHEN s.status = 'completed' THEN '{"ok": true}'::jsonb END, 'bench'
FROM process_instance p,
     (VALUES ('a', 0, 'completed'), ('b', 1, 'running'), ('c', 2, 'pending'))
         AS s(slug, ordinal, status)
""",
)
COUNTS = """
SELECT (SELECT count(*) FROM process_instance), (SELECT count(*) FROM workflow_step_record),
       (SELECT count(*) FROM workflow_step_attempt),
       pg_size_pretty(pg_database_size(current_database()))
"""
SIZE = "SELECT pg_size_pretty(pg_database_size(current_database()))"


def size(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(SIZE).fetchone()
    assert row is not None
    return str(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=25_000)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="steprecord-bench-rekey-") as tmp,
        postgres_server(Path(tmp)) as server,
    ):
        name = f"steprecord_bench_rekey_{uuid.uuid4().hex[:8]}"
        url = create_database(server, name)
        try:
            config = alembic_config()
            config.attributes["database_url"] = url
            command.upgrade(config, "0035")
            with psycopg.connect(url, autocommit=True) as conn:
                began = time.monotonic()
                for statement in LOAD:
                    conn.execute(statement, {"instances": args.instances})
                loaded = time.monotonic() - began
                instances, records, attempts, before = conn.execute(COUNTS).fetchone() or ()
            print(
                f"loaded {instances:,} instances, {records:,} records, {attempts:,} attempts"
                f" in {loaded:.1f} s; database {before}"
            )
            began = time.monotonic()
            command.upgrade(config, "0036")
            print(f"upgrade 0035 -> 0036: {time.monotonic() - began:.1f} s; database {size(url)}")
            with psycopg.connect(url, autocommit=True) as conn:
                keyed = conn.execute(
                    "SELECT count(*) FROM process_instance"
                    " WHERE id = steprecord_instance_id(instance_key)"
                ).fetchone()
                conn.execute("VACUUM (ANALYZE)")
            print(f"instances under their keyed id: {keyed[0] if keyed else 0:,}")
            print(f"after VACUUM (ANALYZE): database {size(url)}")
            began = time.monotonic()
            command.downgrade(config, "0035")
            print(f"downgrade 0036 -> 0035: {time.monotonic() - began:.1f} s; database {size(url)}")
        finally:
            drop_database(server, name)


if __name__ == "__main__":
    main()
