"""`steprecord grant ROLE`: what a runtime role needs to run the service, and nothing more."""

import argparse
import sys

import psycopg
from psycopg.rows import dict_row

from ..data import roles
from .migrate import schema_refusal


async def run_grant(args: argparse.Namespace, url: str) -> int:
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
