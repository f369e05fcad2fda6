"""The `steprecord` command: `serve`, `migrate`, `grant`, `prune`, `token`, `repair` and
`openapi`."""

import argparse
import asyncio
import errno
import json
import os
import pwd
import re
import secrets
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import uvicorn
from alembic import command
from psycopg.rows import dict_row
from pydantic import AliasChoices, ValidationError
from sqlalchemy.exc import DBAPIError
from uvicorn.supervisors import Multiprocess

from app import __version__
from app import main as wiring
from app.access.tokens import SCOPES, new_token
from app.api.bodies import parse_reopen
from app.core import domain
from app.core.config import Settings, is_loopback, parse_duration, redact
from app.core.db import AsyncConn
from app.core.limits import PREFIX_DELIMITED_RE, PREFIX_RE
from app.core.problems import Problem, to_problem
from app.core.serialize import dumps, record_json
from app.core.shown import shown
from app.data import repairs, retention, revision, roles, tokens
from app.main import alembic_config, create_app, known_revisions, schema_head
from app.ops import pruning
from app.ops.distribution import CoordinatorUnknown, WorkerUnreachable, schema_url
from app.ops.embedded import EmbeddedPostgres
from app.ops.server import ServerConfig


def openapi_json() -> str:
    document = create_app().openapi()
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)


def migrate(database_url: str) -> None:
    """Upgrade the database at `database_url` to the migration head."""
    config = alembic_config()
    config.attributes["database_url"] = database_url
    try:
        command.upgrade(config, "head")
    except DBAPIError as exc:
        if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
            raise NotOwner(
                f"this role may not change the schema ({exc.orig.diag.message_primary}): the"
                " schema is not at this release's head, and only the database's owner"
                " migrates it. Run `steprecord migrate` with DATABASE_URL naming the owner,"
                " then start again"
            ) from exc
        raise


class NotOwner(Exception):
    """A migration needed a right of the database's owner that the role lacks (a runtime
    role, `steprecord grant`): the text says what to do."""


@contextmanager
def database(settings: Settings, *, notice: bool = False) -> Iterator[str]:
    """The configured database URL, or an embedded PostgreSQL started for the duration (with
    `notice`, saying where its data lives: `serve` does, the one-off commands do not)."""
    if settings.database_url is not None:
        yield settings.database_url.get_secret_value()
        return
    embedded = EmbeddedPostgres(settings.data_dir)
    if notice:
        print(embedded.notice(), file=sys.stderr)
    with embedded:
        yield embedded.url


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # uvicorn finishes in-flight requests, then re-raises SIGTERM here: leaving by exception
    # lets the embedded PostgreSQL (if any) stop cleanly on the way out.
    raise SystemExit(0)


async def _count_tokens(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, row_factory=dict_row) as conn:
        return len(await tokens.active_tokens(conn))


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port`; raises OSError when the address is taken or unusable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)  # the workers of --workers N inherit it
    return sock


def cannot_listen(host: str, port: int, exc: OSError) -> int:
    if exc.errno == errno.EADDRINUSE:
        reason = f"port {port} is already in use (another steprecord serve?)"
    else:
        reason = exc.strerror or str(exc)
    print(
        f"cannot listen on {host}:{port}: {reason}; choose another port with --port, "
        f"e.g. steprecord serve --port {port + 1 if port < 65535 else 8000}",
        file=sys.stderr,
    )
    return 3


def serve(args: argparse.Namespace) -> int:
    # The address the options give, else the configured one.
    settings = Settings()
    args.host = vars(args).get("host", settings.host)
    args.port = vars(args).get("port", settings.port)
    # Bound before anything else, so a busy port is reported at once; it listens (and the
    # banner says so) only once the database is migrated.
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        return cannot_listen(args.host, args.port, exc)
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    settings = Settings()
    listened = False
    try:
        with database(settings, notice=True) as url:
            try:
                schema = schema_url(url)  # the coordinator, when `url` names a Citus worker
                migrate(schema)
            except (WorkerUnreachable, CoordinatorUnknown, NotOwner) as exc:
                print(f"steprecord serve did not start: {exc}", file=sys.stderr)
                return 1
            public = not is_loopback(args.host) and not args.insecure_no_auth
            if public and asyncio.run(_count_tokens(schema)) == 0:
                print(
                    f"refusing to listen on {args.host} with no access token: create one with\n"
                    "  steprecord token create NAME --scope write\n"
                    "or pass --insecure-no-auth to allow anonymous access until a token exists",
                    file=sys.stderr,
                )
                return 2
            # The workers build their app from the environment.
            os.environ["DATABASE_URL"] = url
            os.environ["STEPRECORD_INSECURE_NO_AUTH"] = "1" if args.insecure_no_auth else "0"
            # One key for the dashboard's sessions across the workers, unless configured.
            os.environ.setdefault("STEPRECORD_SESSION_SECRET", secrets.token_urlsafe(32))
            metrics_dir = None
            if args.workers > 1:
                metrics_dir = tempfile.TemporaryDirectory(prefix="steprecord-metrics-")
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
            try:
                sock.listen()
            except OSError as exc:
                return cannot_listen(args.host, args.port, exc)
            listened = True
            print(_banner(args, settings, url), file=sys.stderr, flush=True)
            config = ServerConfig(
                "app.main:create_app",
                factory=True,
                host=args.host,
                port=args.port,
                workers=args.workers,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=30,
                header_timeout=settings.header_timeout_seconds,
                body_timeout=settings.body_timeout_seconds,
                send_timeout=settings.send_timeout_seconds,
                limit_concurrency=settings.max_connections,
                forwarded_allow_ips=settings.trusted_proxies,
                # A worker answers the supervisor's health check only once it has imported the
                # app; on a busy machine that takes longer than uvicorn's 5 s, and a worker
                # killed for it is replaced by one just as slow, so none would ever start.
                timeout_worker_healthcheck=60,
            )
            server = uvicorn.Server(config)
            try:
                if args.workers > 1:
                    Multiprocess(config, sockets=[sock]).run()
                else:
                    server.run(sockets=[sock])
            except KeyboardInterrupt:
                pass
            finally:
                if metrics_dir is not None:
                    metrics_dir.cleanup()
    finally:
        if listened:  # said once the server and the embedded PostgreSQL, if any, are done
            embedded = (
                "; the embedded PostgreSQL has stopped too" if not settings.database_url else ""
            )
            print(
                f"steprecord stopped listening on {_url(args.host, args.port)}{embedded}",
                file=sys.stderr,
                flush=True,
            )
    return 0 if args.workers > 1 or server.started else 3


# A host that means every address is reached through this machine's loopback address.
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _banner(args: argparse.Namespace, settings: Settings, url: str) -> str:
    """Where `serve` listens, on which database, and the pages to open."""
    if settings.database_url is None:
        # Its URL names port 5432, which is only the name of its socket file.
        where = psycopg.conninfo.conninfo_to_dict(url).get("host")
        database_ = f"the embedded PostgreSQL, listening on a Unix socket in {where} (no TCP port)"
    else:
        database_ = f"database {redact(url)}"
    reads = settings.read_database_url
    if reads is not None:
        database_ += f", reads from replica {redact(reads.get_secret_value())}"
    base = _url(WILDCARDS.get(args.host, args.host), args.port)
    return (
        f"steprecord listening on {_url(args.host, args.port)} (workers: {args.workers}),"
        f" {database_}\n"
        f"  dashboard: {base}/ui\n"
        f"  API docs:  {base}/docs"
    )


async def schema_refusal(conn: AsyncConn, command: str) -> str | None:
    """Why `command` must not run on this database's schema (None: it may).

    Only `migrate` and `serve` change the schema: any other command on a database behind
    this release (or never migrated) stops, rather than upgrade a production database unasked.
    A revision ahead that this release is declared compatible with is accepted, as `serve`
    accepts it; one it does not know is refused, as `serve` would fail on it."""
    current = await revision.schema_revision(conn)
    head = schema_head()
    if current == head or current in wiring.COMPATIBLE_AHEAD:
        return None
    changes = f"`steprecord {command}` never changes the schema"
    if current is None:
        return (
            f"the database has no schema yet; this release needs revision {head}:"
            f" run steprecord migrate first ({changes})"
        )
    if current in known_revisions():
        return (
            f"the database's schema is at revision {current}, behind this release's {head}:"
            f" run steprecord migrate first ({changes})"
        )
    return (
        f"the database's schema is at revision {current}, which this release does not know"
        f" (its newest is {head}): use the steprecord release that migrated it"
    )


async def _token(args: argparse.Namespace, url: str) -> int:
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, row_factory=dict_row
    ) as conn:
        refusal = await schema_refusal(conn, f"token {args.action}")
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 1
        if args.action == "create":
            token, digest = new_token()
            try:
                ended_anonymous = await tokens.create_token(
                    conn, args.name, args.scope, digest, args.prefix
                )
            except domain.ConstraintViolation as exc:
                print(
                    f"cannot create token {args.name!r}: {_refusal(exc, args.name, args.prefix)}",
                    file=sys.stderr,
                )
                return 1
            print(token)
            reach = "" if args.prefix is None else f" for instances starting {args.prefix!r}"
            print(
                f"created {args.scope} token {args.name!r}{reach}; it is shown only once",
                file=sys.stderr,
            )
            if ended_anonymous:
                print(first_token(Settings()), file=sys.stderr)
        elif args.action == "list":
            for row in await tokens.list_tokens(conn):
                used = row["last_used_at"].isoformat() if row["last_used_at"] else "never"
                prefix = row["key_prefix"]
                reach = "all instances" if prefix is None else f"prefix {prefix}"
                print(
                    f"{row['name']}\t{row['scope']}\t{reach}"
                    f"\tcreated {row['created_at'].isoformat()}\tlast used {used}"
                )
            print(USE_RECORDED.format(seconds=Settings().token_refresh_seconds), file=sys.stderr)
        elif args.action == "allow-anonymous":
            if not await tokens.allow_anonymous(conn):
                print(
                    "tokens exist: revoke them first (anonymous access applies only when none"
                    " is left)",
                    file=sys.stderr,
                )
                return 1
            print(
                "with no token, requests made directly to a loopback address are anonymous"
                " again (through a proxy or on a public address only with --insecure-no-auth);"
                " creating a token ends that",
                file=sys.stderr,
            )
        else:
            remaining = await tokens.revoke_token(conn, args.name)
            if remaining is None:
                print(f"no token named {args.name!r}", file=sys.stderr)
                return 1
            print(f"revoked {args.name!r}", file=sys.stderr)
            if remaining == 0:
                print(
                    "that was the last token: every request is refused (401) until a token is"
                    " created with\n  steprecord token create NAME --scope write\n"
                    "or anonymous access is allowed again with\n"
                    "  steprecord token allow-anonymous",
                    file=sys.stderr,
                )
    return 0


def first_token(settings: Settings) -> str:
    """What the first token changes, and how to send it to the configured address."""
    base = _url(WILDCARDS.get(settings.host, settings.host), settings.port)
    return (
        "this is the first token: anonymous access has ended, so curl on localhost and the"
        " dashboard now need a token too.\n"
        f"  curl:      curl -H 'Authorization: Bearer <token>' {base}/v1/instances\n"
        f"  dashboard: open {base}/ui and paste a token on its sign-in page (a read token is"
        " enough)\n"
        f"  client:    Recorder('{base}', token='<token>')\n"
        f"({base} is where STEPRECORD_HOST and STEPRECORD_PORT say steprecord serve listens)"
    )


USE_RECORDED = (
    "each worker records use every {seconds:g} s: a use shows up in `last used` within that"
)


def _refusal(exc: domain.ConstraintViolation, name: str, prefix: str | None) -> str:
    if exc.constraint == "uq_api_token_name":
        return f"a token of that name exists (revoke it with: steprecord token revoke {name})"
    if exc.constraint == "ck_api_token_name_not_reserved":
        return (
            f"the service writes as {name!r} itself (anonymous without tokens, sweeper for a"
            " lease it closed, cli:USER for a repair made with this command), and a token so"
            " named would write under the same name in the records: choose another name,"
            f" e.g. {('ci-' + name.replace(':', '-'))[:200]!r}"
        )
    if exc.constraint == "ck_api_token_name_format":
        return "a name is 1-200 characters of [A-Za-z0-9._:-], starting with a letter or digit"
    if exc.constraint == "ck_api_token_key_prefix_format":
        return PREFIX_RULE
    if exc.constraint == "ck_api_token_key_prefix_separated":
        return undelimited(prefix or "")
    return f"refused by {exc.constraint}"


PREFIX_RULE = (
    "a prefix is 1-100 characters of [A-Za-z0-9._:-], starting with a letter or digit"
    " (the start of an instance key)"
)


def undelimited(prefix: str) -> str:
    """Why a prefix must end with a separator, and the delimited prefix to use instead."""
    stem = prefix.rstrip(".:-") or "acme"
    return (
        f"the prefix {prefix!r} must end with ':', '-' or '.', so that it cannot reach keys that"
        f" merely start the same way ({stem!r} would reach {stem + 'evil-1'!r}):"
        f" use e.g. {stem[:99] + ':'!r}"
    )


def key_prefix(text: str) -> str:
    if not PREFIX_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(PREFIX_RULE)
    if not PREFIX_DELIMITED_RE.search(text):
        raise argparse.ArgumentTypeError(undelimited(text))
    return text


def batch_size(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 10000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 10000")
    return int(text)


def pause_ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 100")
    return value


def prune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`steprecord prune`: bad input is refused (exit 2) before anything is read."""
    try:
        if args.older_than is not None:
            age: timedelta | None = parse_duration(args.older_than)
            before = None
        else:
            age, before = None, pruning.parse_timestamp(args.before)
        if args.archive is not None:
            pruning.check_archive(args.archive)
    except ValueError as exc:
        parser.error(str(exc))
    except FileExistsError:
        parser.error(f"the archive {args.archive} exists: an archive is never overwritten")
    except OSError as exc:
        parser.error(f"cannot write the archive {args.archive}: {exc.strerror or exc}")
    with database(Settings()) as given:
        try:
            url = schema_url(given)
        except CoordinatorUnknown as exc:
            print(f"steprecord prune: {exc}", file=sys.stderr)
            return 1
        return asyncio.run(_prune(url, args, age, before))


async def _prune(
    url: str, args: argparse.Namespace, age: timedelta | None, before: datetime | None
) -> int:
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, row_factory=dict_row
    ) as conn:
        refusal = await schema_refusal(conn, "prune")
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 1
        archive = None
        if args.archive is not None and not args.dry_run:  # created only now, on a good schema
            try:
                archive = pruning.Archive(args.archive)
            except OSError as exc:
                print(
                    f"cannot write the archive {args.archive}: {exc.strerror or exc}",
                    file=sys.stderr,
                )
                return 2

        @asynccontextmanager
        async def connect() -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
            yield conn

        cutoff = before or await retention.database_now(conn) - (age or timedelta())
        try:
            pruned = await pruning.prune(
                connect,
                cutoff,
                include_unfinished=args.include_unfinished,
                dry_run=args.dry_run,
                archive=archive,
                batch=args.batch_size,
                pause=args.pause,
            )
        except pruning.ArchiveFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        finally:
            if archive is not None:
                archive.close()
    print(pruned.summary(cutoff, dry_run=args.dry_run, archive=args.archive))
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option; the epilog's lines kept as written."""


# Settings whose default follows from another's.
DERIVED_DEFAULTS = {
    "pool_share_per_token": "default: half of STEPRECORD_POOL_SIZE, at least 1",
    "pool_share_per_tenant": "default: STEPRECORD_POOL_SHARE_PER_TOKEN",
    "pool_reserve": "default: a fifth of STEPRECORD_POOL_SIZE, at least 1 (0 for a pool of 1)",
}
# Settings that `serve` takes from its own options rather than from the environment.
SERVE_OPTIONS = {"insecure_no_auth": "--insecure-no-auth"}


def setting_variable(name: str) -> str:
    """The environment variable of a `Settings` field."""
    alias = Settings.model_fields[name].validation_alias
    variable = alias.choices[0] if isinstance(alias, AliasChoices) else None
    return str(variable or f"STEPRECORD_{name.upper()}")


def invalid_settings(exc: ValidationError) -> int:
    """A setting the environment gives wrongly: say which and why, without a traceback."""
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "?"
        variable = setting_variable(name) if name in Settings.model_fields else name
        message = str(error["msg"]).removeprefix("Value error, ")
        print(f"invalid setting {variable}: {message}", file=sys.stderr)
    return 2


def environment_help() -> str:
    """The environment variables of the `Settings` class, with their defaults."""
    rows = []
    for name, field in Settings.model_fields.items():
        variable = setting_variable(name)
        if name in SERVE_OPTIONS:
            note = f"set by {SERVE_OPTIONS[name]}"
        elif name in DERIVED_DEFAULTS:
            note = DERIVED_DEFAULTS[name]
        else:
            default = field.get_default(call_default_factory=True)
            note = "unset" if default is None else f"default: {default}"
        rows.append(f"  {variable:<34} {note}")
    return (
        "environment variables:\n"
        + "\n".join(rows)
        + "\n\nWithout DATABASE_URL, serve starts an embedded PostgreSQL in STEPRECORD_DATA_DIR."
    )


def writer_name() -> str:
    """Who the repair log and the reopened record (updated_by) name for a repair made with the
    CLI: `cli:` and the operating system's user of this process (`cli` alone when its user id
    has no name), each character outside a writer's alphabet (a token name's: letters,
    digits, `.`, `_`, `:`, `-`) as `-`. The user comes from the system's user database by
    the process's user id, never from `$USER` or `$LOGNAME`, which anyone may set."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return "cli"
    return re.sub(r"[^A-Za-z0-9._:-]", "-", f"cli:{user}")[:200] if user else "cli"


async def _repair(args: argparse.Namespace, url: str) -> int:
    """`steprecord repair reopen KEY SLUG --reason TEXT [--attempt N]`: the same judge as the
    API's reopen; the record goes to stdout as JSON, any message to stderr."""
    body: dict[str, Any] = {"reason": args.reason}
    if args.attempt is not None:
        body["attempt"] = args.attempt
    try:
        parsed = parse_reopen(args.instance_key, args.step_slug, body)
    except Problem as problem:
        print(f"cannot reopen: {problem.detail}", file=sys.stderr)
        return 2
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, row_factory=dict_row
    ) as conn:
        refusal = await schema_refusal(conn, "repair reopen")
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 1
        by = writer_name()
        try:
            done = await repairs.reopen(
                conn,
                args.instance_key,
                args.step_slug,
                attempt=parsed.attempt,
                reason=parsed.reason,
                by=by,
            )
        except (domain.InstanceNotFound, domain.StepNotFound) as exc:
            print(f"cannot reopen: {to_problem(exc).detail}", file=sys.stderr)
            return 1
    record = record_json(done.record)
    if done.outcome != "reopened":
        attempt, status = record["attempt_count"], record["status"]
        why = {
            "not_finished": "only a completed or failed step is reopened",
            "stale_attempt": f"you named attempt {parsed.attempt}; someone reopened or ran it"
            " since",
        }.get(done.outcome, "no attempt is left after it")
        print(
            f"cannot reopen {args.instance_key}/{args.step_slug}: it is {status} at attempt"
            f" {attempt} ({done.outcome}: {why}); nothing was written",
            file=sys.stderr,
        )
        return 1
    print(shown(dumps(record).decode()))  # a client's text drives no terminal (app/core/shown.py)
    print(
        f"reopened {args.instance_key}/{args.step_slug}: pending at attempt"
        f" {record['attempt_count']}, logged as repaired by {by!r}",
        file=sys.stderr,
    )
    return 0


async def _grant(args: argparse.Namespace, url: str) -> int:
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, row_factory=dict_row
    ) as conn:
        try:
            refusal = await schema_refusal(conn, "grant")
            if refusal is not None:
                print(refusal, file=sys.stderr)
                return 1
            await roles.grant(conn, args.role)
        except psycopg.errors.UndefinedObject:
            print(
                f"steprecord grant: there is no role {args.role!r}: an administrator creates it"
                f" first (CREATE ROLE {args.role} LOGIN PASSWORD '...'), then run this again",
                file=sys.stderr,
            )
            return 1
        except psycopg.errors.InsufficientPrivilege as exc:
            print(
                f"steprecord grant: {exc.diag.message_primary}: run it with DATABASE_URL naming"
                " the database's owner (the role that ran `steprecord migrate`)",
                file=sys.stderr,
            )
            return 1
    print(
        f"granted {args.role!r} what the service needs: it reads every table and writes the"
        " records only through the judge's functions; serve with DATABASE_URL naming it"
        " (`steprecord migrate` keeps these rights)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steprecord", description=__doc__)
    parser.add_argument("--version", action="version", version=f"steprecord {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser(
        "serve",
        help="migrate to head, then serve HTTP",
        description="Migrate the database to head, then serve HTTP.",
        formatter_class=HelpFormatter,
        epilog=environment_help(),
    )
    p_serve.add_argument(
        "--host",
        default=argparse.SUPPRESS,
        help="address to listen on (default: STEPRECORD_HOST, else 127.0.0.1)",
    )
    p_serve.add_argument(
        "--port",
        type=int,
        default=argparse.SUPPRESS,
        help="TCP port to listen on (default: STEPRECORD_PORT, else 8000)",
    )
    p_serve.add_argument("--workers", type=int, default=1, help="worker processes")
    p_serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow starting on a non-loopback address before any token exists",
    )
    sub.add_parser("migrate", help="upgrade the database to the migration head")
    sub.add_parser("openapi", help="print the OpenAPI document")
    p_grant = sub.add_parser(
        "grant",
        help="let a role run the service: read, and write only through the judge",
        description="Grant ROLE what `serve` needs and nothing more: it reads every table and"
        " writes the records only through the judge's functions. Run it as the database's"
        " owner, after `steprecord migrate` (which keeps these rights through upgrades); the"
        " role must exist.",
    )
    p_grant.add_argument("role")
    p_token = sub.add_parser("token", help="create, list or revoke access tokens")
    actions = p_token.add_subparsers(dest="action", required=True)
    p_create = actions.add_parser("create", help="print a new token (once) and store its hash")
    p_create.add_argument("name")
    p_create.add_argument("--scope", choices=SCOPES, required=True)
    p_create.add_argument(
        "--prefix",
        type=key_prefix,
        help="reach only the instances whose key starts with PREFIX, which ends with ':', '-'"
        " or '.' (others do not exist for this token); without it, every instance",
    )
    actions.add_parser(
        "list",
        help="names, scopes and times, never the tokens; a use shows up within"
        " STEPRECORD_TOKEN_REFRESH_SECONDS (default 2)",
    )
    p_prune = sub.add_parser(
        "prune",
        help="delete the instances last written before a cutoff",
        description="Delete every instance whose last write is before the cutoff and none of"
        " whose steps is pending or running, with its records and their history, in short"
        " batches. Prints one summary line.",
        formatter_class=HelpFormatter,
    )
    cutoff = p_prune.add_mutually_exclusive_group(required=True)
    cutoff.add_argument(
        "--older-than", metavar="DURATION", help="last written longer ago than 90s, 12h, 30d, 2w"
    )
    cutoff.add_argument(
        "--before", metavar="TIMESTAMP", help="last written before 2026-11-01T00:00:00Z"
    )
    p_prune.add_argument(
        "--include-unfinished",
        action="store_true",
        help="also delete instances with pending or running steps",
    )
    p_prune.add_argument("--dry-run", action="store_true", help="delete nothing; report")
    p_prune.add_argument(
        "--batch-size",
        type=batch_size,
        metavar="N",
        default=pruning.BATCH,
        help="instances judged and deleted per transaction (1-10000)",
    )
    p_prune.add_argument(
        "--pause",
        type=pause_ratio,
        metavar="RATIO",
        default=pruning.PAUSE,
        help="seconds paused between batches per second of work (1: deletes at most half the"
        " time, leaving the writes room; 0: full speed)",
    )
    p_prune.add_argument(
        "--archive",
        metavar="PATH",
        type=Path,
        help="first write each instance as one JSON line to this new .jsonl or .jsonl.gz file",
    )
    p_revoke = actions.add_parser("revoke", help="end a token's access")
    p_revoke.add_argument("name")
    actions.add_parser(
        "allow-anonymous",
        help="with no token left, let direct loopback requests be anonymous again",
    )
    p_repair = sub.add_parser(
        "repair",
        help="repair a process by hand, through the judge, kept in the repair log",
    )
    repair_actions = p_repair.add_subparsers(dest="action", required=True)
    p_reopen = repair_actions.add_parser(
        "reopen",
        help="make a completed or failed step pending at its next attempt",
        description="Make a completed or failed step pending at its next attempt, so that it"
        " runs again; the repair log keeps the reason, the attempt and who (cli:OS user).",
    )
    p_reopen.add_argument("instance_key")
    p_reopen.add_argument("step_slug")
    p_reopen.add_argument("--reason", required=True, help="why, 1 to 500 characters")
    p_reopen.add_argument(
        "--attempt",
        type=int,
        help="the attempt you saw finished: refused if another one is current",
    )
    args = parser.parse_args(argv)
    try:
        return run(args, p_prune)
    except ValidationError as exc:
        return invalid_settings(exc)


def run(args: argparse.Namespace, p_prune: argparse.ArgumentParser) -> int:
    if args.command == "serve":
        return serve(args)
    if args.command == "prune":
        return prune(p_prune, args)
    if args.command == "openapi":
        print(openapi_json())
        return 0
    with database(Settings()) as given:
        # Pointed at a Citus worker, the one-off commands work on its coordinator.
        try:
            url = schema_url(given)
        except CoordinatorUnknown as exc:
            print(f"steprecord {args.command}: {exc}", file=sys.stderr)
            return 1
        if args.command == "token":  # never migrates: see `schema_refusal`
            return asyncio.run(_token(args, url))
        if args.command == "repair":  # nor does a repair
            return asyncio.run(_repair(args, url))
        if args.command == "grant":
            return asyncio.run(_grant(args, url))
        try:
            migrate(url)
        except WorkerUnreachable as exc:
            print(f"steprecord migrate {exc}", file=sys.stderr)
            return 1
        except NotOwner as exc:
            print(f"steprecord migrate: {exc}", file=sys.stderr)
            return 1
        print(f"database {redact(url)} is at the migration head", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
