"""steprecord: one durable, database-guarded record per step of a process instance.

The packages, each importing only the ones before it (tests/test_layers.py checks it):

- `core`: the shapes of data and the plumbing every layer shares (domain types, the record's
  fields, the tables, problems, JSON, the pool, settings); imports nothing else of `app`;
- `data` and `sql`: the data layer, all SQL the service sends, and the database functions
  (the judge) it calls;
- `ops`: what runs beside the routes (server, embedded database, observability, sweeper,
  pruning, replica, Citus nodes and distribution);
- `access`: tokens, tenants, the dashboard's sessions;
- `live`: live updates, one LISTEN session per worker and the Server-Sent Events streams;
- `api`: the HTTP API (routes, bodies, the OpenAPI shapes, docs);
- `dashboard`: the pages at `/ui`, their formatting, rendering, timeline, templates and
  assets, and the sign-in;
- `gate`: the access check in front of every route;
- `main` wires them into the app, and `cli` is the `steprecord` command, a module per
  subcommand.

Installed, this package is `steprecord` and `migrations/` is `steprecord.migrations` inside it
(pyproject.toml maps them): nothing generic at the top of site-packages. In a clone they are the
folders `app/` and `migrations/`, so every module here imports the others relatively, the same
files under either name; `migrations/env.py` and the revisions, which alembic loads by path,
name neither (`app.main.migration_environment`, `app/data/migrating.py`).

One event, from request to row (`POST /v1/instances/{key}/steps/{slug}/start`):
`app/gate.py` lets the request in (`app/access/tokens.py`: its token, its `Admission`);
`app/api/routes/events.py` handles it: `app/access/tenancy.py` checks the key's prefix,
`app/api/bodies.py` parses the body into an `Event` (`app/core/domain.py`), and
`app/api/routes/common.py` picks the pool (on Citus, the instance's node: `app/ops/nodes.py`);
`app/data/judge.py` sends one statement, `steprecord_apply_event`, whose function
(`app/sql/apply_event.sql`, rules in `app/sql/judge_rules.sql`) judges the event under the
record's row lock and writes the row of `workflow_step_record` (`app/core/tables.py`, fields
in `app/core/record.py`); `app/api/routes/refusals.py` turns the outcome into the answer,
rendered by `app/core/serialize.py`. The row's trigger (`app/sql/live_updates.sql`) notifies,
and `app/live.py` wakes the instance's streams, which read it through `app/data/stream.py`.
"""

from pathlib import Path

# The one place the version is written: the wheel's metadata, `steprecord --version` and the
# OpenAPI document take it from here.
__version__ = "0.1.0"

# `migrations/`: inside this package when installed (`steprecord/migrations`), beside it in a
# clone. The service runs them (`alembic_config()`), `python -m app.sql freeze` writes to them.
_INSTALLED = Path(__file__).resolve().parent / "migrations"
MIGRATIONS = _INSTALLED if _INSTALLED.is_dir() else _INSTALLED.parent.parent / "migrations"
