"""`steprecord serve`: migrate to head, then serve HTTP on the socket it binds first."""

import argparse
import asyncio
import errno
import os
import secrets
import signal
import socket
import sys
import tempfile

import psycopg
import uvicorn
from psycopg.rows import dict_row
from uvicorn.supervisors import Multiprocess

from .. import main
from ..core.config import Settings, is_loopback, redact
from ..data import tokens
from ..ops.distribution import CoordinatorUnknown, WorkerUnreachable, schema_url
from ..ops.server import ServerConfig
from .migrate import NotOwner, database, migrate


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
                f"{main.__name__}:create_app",  # `app` in a clone, `steprecord` installed
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
                f"steprecord stopped listening on {http_url(args.host, args.port)}{embedded}",
                file=sys.stderr,
                flush=True,
            )
    return 0 if args.workers > 1 or server.started else 3


# A host that means every address is reached through this machine's loopback address.
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def http_url(host: str, port: int) -> str:
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
    base = http_url(WILDCARDS.get(args.host, args.host), args.port)
    return (
        f"steprecord listening on {http_url(args.host, args.port)} (workers: {args.workers}),"
        f" {database_}\n"
        f"  dashboard: {base}/ui\n"
        f"  API docs:  {base}/docs"
    )
