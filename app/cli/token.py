"""`steprecord token`: create, list or revoke access tokens, and let anonymous access back."""

import argparse
import sys

import psycopg
from psycopg.rows import dict_row

from ..access.tokens import new_token
from ..core import domain
from ..core.config import Settings
from ..core.limits import PREFIX_DELIMITED_RE, PREFIX_RE
from ..data import tokens
from .migrate import schema_refusal
from .serve import WILDCARDS, http_url


async def run_token(args: argparse.Namespace, url: str) -> int:
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
    base = http_url(WILDCARDS.get(settings.host, settings.host), settings.port)
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
