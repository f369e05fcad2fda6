"""The `steprecord` command: `serve`, `migrate` and `openapi`."""

import argparse
import ipaddress
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from alembic import command

from app.config import Settings, redact
from app.embedded import EmbeddedPostgres
from app.main import alembic_config, create_app


def openapi_json() -> str:
    document = create_app().openapi()
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)


def migrate(database_url: str) -> None:
    """Upgrade the database at `database_url` to the migration head."""
    config = alembic_config()
    config.attributes["database_url"] = database_url
    command.upgrade(config, "head")


@contextmanager
def database(settings: Settings) -> Iterator[str]:
    """The configured database URL, or an embedded PostgreSQL started for the duration."""
    if settings.database_url is not None:
        yield settings.database_url.get_secret_value()
        return
    embedded = EmbeddedPostgres(settings.data_dir)
    print(f"starting embedded PostgreSQL in {embedded.pgdata}", file=sys.stderr)
    with embedded:
        yield embedded.url


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # uvicorn finishes in-flight requests, then re-raises SIGTERM here: leaving by exception
    # lets the embedded PostgreSQL (if any) stop cleanly on the way out.
    raise SystemExit(0)


def serve(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    settings = Settings()
    with database(settings) as url:
        migrate(url)
        os.environ["DATABASE_URL"] = url  # the workers build their app from the environment
        print(
            f"steprecord listening on http://{args.host}:{args.port}"
            f" (workers: {args.workers}), database {redact(url)}",
            file=sys.stderr,
            flush=True,
        )
        uvicorn.run(
            "app.main:create_app",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=30,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steprecord", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="migrate to head, then serve HTTP")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--workers", type=int, default=1)
    sub.add_parser("migrate", help="upgrade the database to the migration head")
    sub.add_parser("openapi", help="print the OpenAPI document")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "openapi":
        print(openapi_json())
        return 0
    with database(Settings()) as url:
        migrate(url)
        print(f"database {redact(url)} is at the migration head", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
