"""`steprecord repair reopen`: an operator's reopen of a finished step, through the judge."""

import argparse
import os
import pwd
import re
import sys
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..api.bodies import parse_reopen
from ..core import domain
from ..core.problems import Problem, to_problem
from ..core.serialize import dumps, record_json
from ..core.shown import shown
from ..data import repairs
from .migrate import schema_refusal


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


async def run_repair(args: argparse.Namespace, url: str) -> int:
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
