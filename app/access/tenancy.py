"""Tenant-scoped tokens: a token made with a key prefix reaches only the instances whose key
starts with it.

For such a token the other instances do not exist: a read of one answers exactly as for a
missing instance (404 `instance_not_found`), a write to one is refused (403 `outside_prefix`)
before anything is written, and the lists read only the prefix's range of keys. Tokens
without a prefix, and anonymous loopback access, reach every instance.

The access check (app/gate.py) puts the prefix of the request's token in the request's
state; the routes ask here.
"""

from starlette.types import Scope

from ..core.domain import InstanceNotFound
from ..core.problems import Problem

STATE_KEY = "key_prefix"


def set_prefix(scope: Scope, prefix: str) -> None:
    scope.setdefault("state", {})[STATE_KEY] = prefix


def prefix_of(scope: Scope) -> str | None:
    """The key prefix of the request's token; None when the request reaches every instance."""
    state = scope.get("state")
    return None if state is None else state.get(STATE_KEY)


def check_read(scope: Scope, instance_key: str) -> None:
    """Raise InstanceNotFound, the same answer as for a missing instance, when the request's
    token does not reach `instance_key`."""
    prefix = prefix_of(scope)
    if prefix is not None and not instance_key.startswith(prefix):
        raise InstanceNotFound(instance_key)


def check_write(scope: Scope, instance_keys: list[str]) -> None:
    """Refuse (403 `outside_prefix`) a write naming any instance the request's token does not
    reach; a batch is refused whole."""
    prefix = prefix_of(scope)
    if prefix is None:
        return
    outside = [key for key in instance_keys if not key.startswith(prefix)]
    if not outside:
        return
    where = f"instance {outside[0]!r}" if len(instance_keys) == 1 else _batch(outside)
    raise Problem(
        403,
        "outside_prefix",
        f"this token reaches only instances whose key starts with {prefix!r}, and the request"
        f" names {where}: nothing was written; use keys that start with {prefix!r}, or a"
        " token that reaches these instances",
        prefix=prefix,
    )


def check_unscoped(scope: Scope, why: str) -> None:
    """Refuse (403 `forbidden`) a token with a key prefix where the answer covers every
    instance and cannot be narrowed to the prefix."""
    prefix = prefix_of(scope)
    if prefix is not None:
        raise Problem(
            403,
            "forbidden",
            f"{why}, and this token reaches only instances whose key starts with {prefix!r}:"
            " use a token without a prefix",
        )


def _batch(outside: list[str]) -> str:
    more = len(outside) - 1
    return f"instance {outside[0]!r}" + (f" and {more} more outside it" if more else "")


def narrow(token_prefix: str | None, wanted: str | None) -> tuple[bool, str | None]:
    """The prefix a list filtered by `wanted` reads for a token reaching `token_prefix`:
    (False, None) when no key can start with both."""
    if token_prefix is None or (wanted is not None and wanted.startswith(token_prefix)):
        return True, wanted
    if wanted is None or token_prefix.startswith(wanted):
        return True, token_prefix
    return False, None
