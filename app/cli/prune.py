"""`steprecord prune`: delete the instances last written before a cutoff."""

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..core.config import Settings, parse_duration
from ..data import retention
from ..ops import pruning
from ..ops.distribution import CoordinatorUnknown, schema_url
from .migrate import database, schema_refusal


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
