"""Distribution on Citus: run by every `steprecord migrate` (and `serve`, which migrates) after
the migrations, in the same transaction and under the same advisory lock.

On a database without the `citus` extension it does nothing: one node migrates exactly as
before. Where the operator has created the extension (on the coordinator and every worker,
the workers added with `citus_add_node`), it distributes what is not distributed yet and
sets what is not set yet, reading each first: a migrate with nothing to do issues no DDL, so
it reaches no worker (`serve`, which migrates, starts while one is down). A database that
held rows before the extension came is distributed by the next migrate (Citus copies the rows
to the workers' shards; the tables are locked meanwhile, see docs/operations.md). A migrate
that must change a worker the coordinator cannot reach stops with `WorkerUnreachable`, which
names it (the migration's transaction rolled back):

1. `citus.enable_unsafe_triggers = on` for the database: Citus distributes a table with
   triggers, and runs them on each shard, only so. The record's guard, its history and
   notification triggers, the history's guard and the changed-xid stamp are row triggers,
   which run on the shard beside the row (the history's write its record's history row on the
   co-located shard). The schema's functions are copied to every worker (those made before
   the extension came).
2. `api_token` and `access_policy` stay on the coordinator, plain tables: only the service
   reads them there, no statement joins them with a distributed table, and the trigger that
   makes a first token require tokens writes `access_policy` from `api_token`, which Citus
   refuses between reference tables (a trigger on a reference table's copy on a worker may
   not run a distributed statement).
3. `process_instance` by `id`, in `citus.shard_count` shards where the operator set that
   setting (for the server, the database, a role or the session), else in `SHARD_COUNT` (8,
   not Citus's 32: a list across instances asks every shard, and with 32 shards on two
   workers such a list cost the cluster 2.6 times what it costs with 8, docs/scaling.md);
   then `workflow_step_record`, `workflow_step_attempt` and
   `workflow_step_repair` (the repair log) by `instance_id`, co-located with it: one
   instance's rows live together on one worker.
   `uq_process_instance_instance_key` is dropped first (Citus keeps only unique keys that
   include the distribution column); the primary key `id` and the CHECK
   `ck_process_instance_id_derived` (id = steprecord_instance_id(instance_key)) hold it.
4. `steprecord_apply_event` becomes a distributed function whose distribution argument is
   `p_instance_id`, co-located with `process_instance`: the coordinator sends the whole call
   to the worker that holds the instance; so do `steprecord_reopen` (an operator's repair),
   `steprecord_stream_changes` (a stream's read, whose snapshot and transaction ids must
   be that worker's) and `steprecord_sweep_instance` (the sweeper's write of one
   instance). (`steprecord_apply_events_on_shard`, which revisions 0023 to 0029 had,
   is delegated too when a downgrade brings it back.)
5. The judge's functions whose statements join distributed tables plan each statement with
   its values (`force_custom_plan`): Citus routes such a statement to one shard only when it
   sees the distribution column's value, which a generic plan hides behind a parameter (a
   join of distributed tables under a generic plan: "could not create distributed plan").
   `steprecord_apply_event` is not among them: each of its statements reads or writes one
   table by its distribution column, which Citus routes with a generic plan, kept per
   connection as on one node.
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.conninfo import make_conninfo
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from ..core.db import remote_node_failed
from ..data import placement

# Citus's distributed tables with their distribution column, in the order they are
# distributed (a co-located table after the one it follows).
DISTRIBUTED_TABLES = (
    ("process_instance", "id"),
    ("workflow_step_record", "instance_id"),
    ("workflow_step_attempt", "instance_id"),
    ("workflow_step_repair", "instance_id"),
)
# The functions delegated to the worker that holds the instance (4. above), by name: the
# revision the database is at decides their arguments (a downgrade creates them again, as they
# were), and each is delegated once it is there and takes `p_instance_id`. The one-event
# judge; the general statement on one worker's shards (before revision 0030); an operator's
# reopen (app/sql/reopen.sql); a stream's read, whose snapshot and transaction ids are the
# worker's; the sweeper's write of one instance (app/sql/sweeper.sql).
DELEGATED_FUNCTIONS = (
    "steprecord_apply_event",
    "steprecord_apply_events_on_shard",
    "steprecord_reopen",
    "steprecord_stream_changes",
    "steprecord_sweep_instance",
)
CUSTOM_PLANS = (
    "steprecord_reopen",
    "steprecord_apply_events",
    "steprecord_heartbeat",
    "steprecord_list_page",
    "steprecord_delete_instance",
    "steprecord_prune_due",
    "steprecord_prune_delete",
    "steprecord_patch_labels",
)

HAS_CITUS = "SELECT 1 FROM pg_extension WHERE extname = 'citus'"
# The instances' shards where the operator has not set `citus.shard_count` (3. above).
SHARD_COUNT = 8
SHARDS = """
SELECT CASE WHEN source = 'default' THEN %s ELSE setting::int END
FROM pg_settings WHERE name = 'citus.shard_count'
"""
# The database's own setting (for every role) that Citus's triggers need, if it is there.
UNSAFE_TRIGGERS_SET = """
SELECT 1 FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase
WHERE d.datname = current_database() AND s.setrole = 0
  AND 'citus.enable_unsafe_triggers=on' = ANY (s.setconfig)
"""
# A table the database's revision has (the repair log came with 0024) and that is not
# distributed yet.
UNDISTRIBUTED = """
SELECT 1 WHERE to_regclass(%(table)s) IS NOT NULL AND NOT EXISTS
    (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass(%(table)s))
"""
FUNCTION_DISTRIBUTED = """
SELECT 1 FROM pg_dist_object
WHERE classid = 'pg_proc'::regclass AND objid = %s::regprocedure AND distribution_argument_index
IS NOT NULL
"""

# The schema's function of that name, if the database's revision has it, with its arguments.
NAMED_FUNCTION = """
SELECT p.oid::regprocedure::text, 'p_instance_id' = ANY (p.proargnames) FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public' AND p.proname = %s
"""
# The schema's function of that name, if it does not plan with its values yet (a migration
# that replaces a function drops the settings of its old one).
GENERIC_PLAN_FUNCTION = """
SELECT p.oid::regprocedure::text FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public' AND p.proname = %s
  AND NOT coalesce('plan_cache_mode=force_custom_plan' = ANY (p.proconfig), false)
"""

# The schema's functions that the workers do not have yet: those made before the extension
# came (Citus copies a function made later to every node itself). The shards' triggers and
# the delegated judge call them on the workers.
# The schema's functions in the order they were made, but the database's secret for
# instance ids first: a worker checks a function's body when it is created there, and
# steprecord_instance_id (made by an earlier revision) calls it. (PostgreSQL records no
# dependency of one SQL function's body on another, so Citus cannot order them itself.)
LOCAL_FUNCTIONS = """
SELECT p.oid::regprocedure::text FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public'
  AND NOT EXISTS (SELECT 1 FROM pg_depend d
                  WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')
  AND NOT EXISTS (SELECT 1 FROM pg_dist_object o
                  WHERE o.classid = 'pg_proc'::regclass AND o.objid = p.oid)
ORDER BY p.proname <> 'steprecord_instance_id_key', p.oid
"""


# The copies of the judge that Citus nodes made for their shards (app/sql/shard_judge.sql),
# dropped on every node before a migrate that changes the schema: a copy names the judge's
# answer type, which a revision may drop and make again (the copies are made again on first
# use). Over connections of Citus's own, outside the migration's transaction; a node that
# cannot be reached keeps its copies, and the migration, which must change it too, then
# stops naming it.
SHARD_JUDGES_KNOWN = "SELECT to_regproc('steprecord_drop_shard_judges') IS NOT NULL"
DROP_SHARD_JUDGES = (
    "SELECT count(*) FROM run_command_on_all_nodes('SELECT steprecord_drop_shard_judges()')"
)


def drop_shard_judges(connection: Connection) -> None:
    """Before migrations on Citus: every node's copies of the judge dropped (above)."""
    if has_citus(connection) and connection.exec_driver_sql(SHARD_JUDGES_KNOWN).scalar_one():
        connection.exec_driver_sql(DROP_SHARD_JUDGES)


def custom_plan_statements() -> list[str]:
    """The statements by which distribution makes the judge's functions plan with their values
    (5. above): all it changes in the functions `app/sql/` defines."""
    return [custom_plan(function) for function in CUSTOM_PLANS]


def custom_plan(function: str) -> str:
    return f"ALTER FUNCTION {function} SET plan_cache_mode = force_custom_plan"


def schema_url(url: str) -> str:
    """The URL of the node that holds the schema's own tables (`alembic_version`, the tokens):
    `url` itself, or the Citus coordinator when `url` names a worker. Every node has Citus's
    metadata, so a worker names its coordinator; `serve` pointed at a worker migrates and
    keeps its tokens there, and judges and reads on the worker. A database that cannot be
    reached is left to the caller's own error; a worker that names no coordinator is
    `CoordinatorUnknown` (nothing is created on it)."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            if conn.execute(HAS_CITUS).fetchone() is None:
                return url
            row = conn.execute(placement.COORDINATOR).fetchone()
    except psycopg.OperationalError:
        return url
    if row is None:
        return url
    host, port = row
    if host is None:
        raise CoordinatorUnknown(
            "this database is on a Citus worker whose metadata names no coordinator, so"
            " steprecord cannot tell where its schema belongs: run `steprecord migrate`"
            " against the coordinator (or register it there with"
            " `SELECT citus_set_coordinator_host('HOST', PORT)`), then try again"
        )
    return make_conninfo(url, host=host, port=port)


class CoordinatorUnknown(Exception):
    """Pointed at a Citus worker whose metadata names no coordinator: nothing was done."""


def has_citus(connection: Connection) -> bool:
    return connection.exec_driver_sql(HAS_CITUS).first() is not None


def distribute(connection: Connection) -> bool:
    """Distribute the schema when the database has Citus; False (and nothing done) without."""
    if not has_citus(connection):
        return False
    sql = connection.exec_driver_sql
    # Each step reads what is in place and changes only what is missing: a migrate with
    # nothing to do issues no DDL, so it reaches no worker (one that is down does not stop
    # it) and leaves the functions as they are (their catalog rows, which Citus's prepared
    # statements on the shards are cached by, unchanged).
    if sql(UNSAFE_TRIGGERS_SET).first() is None:
        database = sql("SELECT current_database()").scalar_one()
        sql(f'ALTER DATABASE "{database}" SET citus.enable_unsafe_triggers = on')
    sql("SET LOCAL citus.enable_unsafe_triggers = on")
    # One connection per worker for the whole transaction: Citus distributes a function only
    # so once the same transaction has written distributed tables (the rows copied below).
    sql("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
    for (function,) in sql(LOCAL_FUNCTIONS).all():
        sql("SELECT create_distributed_function(%s)", (function,))
    for table, column in DISTRIBUTED_TABLES:
        if sql(UNDISTRIBUTED, {"table": table}).first() is None:
            continue
        if table == "process_instance":
            sql(
                "ALTER TABLE process_instance"
                " DROP CONSTRAINT IF EXISTS uq_process_instance_instance_key"
            )
        # The rows copied to the shards are no new writes: the triggers stay off meanwhile
        # (the history's trigger would write the history again, before its table is there).
        sql(f"ALTER TABLE {table} DISABLE TRIGGER USER")
        if table == "process_instance":
            shards = sql(SHARDS, (SHARD_COUNT,)).scalar_one()
            sql(
                "SELECT create_distributed_table(%s, %s, colocate_with => 'none',"
                " shard_count => %s)",
                (table, column, shards),
            )
        else:
            sql(
                "SELECT create_distributed_table(%s, %s, colocate_with => 'process_instance')",
                (table, column),
            )
        sql(f"ALTER TABLE {table} ENABLE TRIGGER USER")
    for name in DELEGATED_FUNCTIONS:
        for function, by_instance in sql(NAMED_FUNCTION, (name,)).all():
            if by_instance and sql(FUNCTION_DISTRIBUTED, (function,)).first() is None:
                sql(
                    "SELECT create_distributed_function(%s, 'p_instance_id',"
                    " colocate_with => 'process_instance')",
                    (function,),
                )
    for name in CUSTOM_PLANS:
        for (function,) in sql(GENERIC_PLAN_FUNCTION, (name,)).all():
            sql(custom_plan(function))
    return True


class WorkerUnreachable(Exception):
    """A migration had to change a Citus worker that the coordinator cannot reach. Its text
    tells the person who ran it what was not done, which worker, and what to do."""


# The coordinator's words for a worker it cannot reach: the worker as [user@]host:port, then
# the connection's error (its first line says why).
REMOTE_NODE = re.compile(
    r"connection to the remote node (?:\S*@)?(\S+) failed with the following error: ([^\n]*)"
)


@contextmanager
def reaching_workers(what: str) -> Iterator[None]:
    """Turns the coordinator's failure to reach a worker, while doing `what` (words that
    follow "could not"), into `WorkerUnreachable`; any other error passes as it is."""
    try:
        yield
    except DBAPIError as exc:
        cause = exc.orig
        if not isinstance(cause, psycopg.Error) or not remote_node_failed(cause):
            raise
        found = REMOTE_NODE.match(cause.diag.message_primary or "")
        worker, reason = found.groups() if found else ("of the cluster", "unknown")
        statement = (exc.statement or "").strip()
        running = f" (running `{statement}`)" if statement and "\n" not in statement else ""
        raise WorkerUnreachable(
            f"could not {what}{running}: the Citus worker {worker} cannot be reached"
            f" ({reason.strip()}), and this must change it too. Nothing was changed: the"
            " migration is one transaction, rolled back. Start that worker (or let the"
            " coordinator reach it), then run `steprecord migrate` again."
        ) from exc
