"""The `steprecord` command: `serve`, `migrate`, `grant`, `prune`, `token`, `repair` and
`openapi`."""

import argparse
import asyncio
import sys
from pathlib import Path

from pydantic import AliasChoices, ValidationError

from .. import __version__
from ..access.tokens import SCOPES
from ..core.config import Settings, redact
from ..ops import pruning
from ..ops.distribution import CoordinatorUnknown, WorkerUnreachable, schema_url
from .grant import run_grant
from .migrate import NotOwner, database, migrate
from .openapi import openapi_json
from .prune import batch_size, pause_ratio, prune
from .repair import run_repair
from .serve import serve
from .token import key_prefix, run_token


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
            return asyncio.run(run_token(args, url))
        if args.command == "repair":  # nor does a repair
            return asyncio.run(run_repair(args, url))
        if args.command == "grant":
            return asyncio.run(run_grant(args, url))
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
