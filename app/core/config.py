"""Settings, from the environment (prefix `STEPRECORD_`, plus `DATABASE_URL`)."""

import functools
import ipaddress
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Self

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/steprecord")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "steprecord"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPRECORD_", extra="ignore")

    database_url: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL", "STEPRECORD_DATABASE_URL")
    )
    # A PostgreSQL streaming replica for the reads; unset: every read goes to the primary.
    read_database_url: SecretStr | None = None
    # Reads bypass the replica while it is down or further behind the primary than this.
    read_max_lag_seconds: float = Field(default=5.0, gt=0, le=3600)
    data_dir: Path = Field(default_factory=default_data_dir)
    # Where `serve` listens unless --host and --port say otherwise; the other commands name
    # this address too (`token create` shows how to reach the service with a new token).
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    pool_size: int = Field(default=10, ge=1, le=500)
    # The connections of a worker's pool one token (or anonymous access) may hold at once;
    # its requests beyond wait up to `db_timeout`, then 429. Unset: half the pool, at least 1.
    pool_share_per_token: int | None = Field(default=None, ge=1, le=500)
    # The connections the tokens of one key prefix (a tenant) may hold together; beyond, as
    # above. Unset: the same as a token's share.
    pool_share_per_tenant: int | None = Field(default=None, ge=1, le=500)
    # The last free connections of a pool, which only a request whose token and tenant hold
    # none may take: no one token or tenant can take them. Unset: a fifth of the pool, at
    # least 1 (0 for a pool of 1); at most the pool's size less one.
    pool_reserve: int | None = Field(default=None, ge=0, le=499)
    # Seconds a request may wait for a connection (or to open one) before it answers 503.
    db_timeout: float = Field(default=1.5, gt=0, le=30)
    # Seconds a request's statements may run (lock waits included) before they are cancelled
    # and the request answers 503.
    statement_timeout: float = Field(default=5.0, gt=0, le=600)
    # psycopg's prepare_threshold: server-side prepared statements from a statement's first
    # use (0); `none` keeps none, for PgBouncer before 1.21 in transaction mode.
    prepare_threshold: int | None = Field(default=0, ge=0)
    # On Citus: send each instance's events, heartbeats and reads straight to the node holding
    # it (app/ops/nodes.py), reading the coordinator's shard map every `shard_map_seconds`; off:
    # every call goes to the node the database URL names, which delegates it.
    citus_direct: bool = True
    shard_map_seconds: float = Field(default=10.0, gt=0, le=3600)
    # Anonymous access while no token exists also through a proxy or a public address.
    insecure_no_auth: bool = False
    # How often each worker reloads the tokens (revocations take effect within this time).
    token_refresh_seconds: float = Field(default=2.0, gt=0, le=60)
    # How often the sweeper fails running attempts whose lease expired; 0 turns it off.
    sweep_seconds: float = Field(default=5.0, ge=0, le=3600)
    # The session that LISTENs for live updates (a direct connection: not through PgBouncer in
    # transaction mode); None means the database URL.
    listen_url: SecretStr | None = None
    # Seconds of silence after which an open stream sends a keepalive comment.
    stream_heartbeat_seconds: float = Field(default=15.0, gt=0, le=3600)
    # Seconds a stream stays open at most; then it ends, and a browser reconnects by itself
    # (its access checked afresh).
    stream_max_seconds: float = Field(default=3600.0, gt=0, le=86400)
    # Streams one token (or anonymous access) may hold open on one worker; beyond, 429.
    streams_per_token: int = Field(default=100, ge=1, le=100000)
    # Finished instances last written longer ago than this are deleted in the background
    # (`30d`, `12h`); unset: kept forever.
    retention: timedelta | None = None
    # A running step without a lease that started longer ago than this (`90m`, `2h`) shows on
    # the dashboard's Stuck page and in the `steprecord_long_running_steps` gauge.
    long_running_after: timedelta = timedelta(hours=1)
    # The dashboard links each attempt to its trace: a URL template containing `{trace_id}`
    # (e.g. `https://jaeger.example/trace/{trace_id}`); unset: the trace id shown as text.
    trace_url: str | None = None

    # Seconds a client has to send a request's headers (slow clients: see app/ops/server.py);
    # then 408 and the connection is closed.
    header_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    # Seconds a client has, once its headers are in, to send the request's body; then 408
    # and the connection is closed. (An answer sent before the body was read, a 401 or a 413,
    # always closes the connection.)
    body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    # Seconds an answer waits for a client that stopped reading it (its connection's send
    # buffer full, nothing taken meanwhile); then the connection is closed: a stream whose
    # client stopped reading ends.
    send_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    # Connections one worker serves at once; beyond, a request is answered 503 at once.
    max_connections: int = Field(default=1000, ge=1, le=1000000)

    # The key that signs the dashboard's sessions (its cookie names a token, never holds it);
    # unset: `serve` makes one at start for its workers, so sessions end when it restarts and
    # are not shared with other instances: give every instance the same one to share them.
    session_secret: SecretStr | None = None
    # How long a dashboard session lasts before the browser asks for the token again.
    session_seconds: float = Field(default=43200.0, ge=60, le=30 * 86400)
    # Proxies whose X-Forwarded-Proto (and X-Forwarded-For) are believed: addresses or
    # networks, comma-separated, or `*` when only the proxy can reach the service. A request
    # one of them says came over https gets the dashboard's cookie marked `Secure`.
    trusted_proxies: str = "127.0.0.1,::1"

    @model_validator(mode="after")
    def _reserve_leaves_room(self) -> Self:
        if self.pool_reserve is not None and self.pool_reserve >= self.pool_size:
            raise ValueError(
                f"STEPRECORD_POOL_RESERVE ({self.pool_reserve}) must be smaller than"
                f" STEPRECORD_POOL_SIZE ({self.pool_size}): a busy token holds at least one"
                " connection beyond the reserve"
            )
        return self

    @field_validator("session_secret")
    @classmethod
    def _secret_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError(
                "a session secret is at least 32 characters: make one with"
                " python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @field_validator("prepare_threshold", mode="before")
    @classmethod
    def _none(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @field_validator("retention", mode="before")
    @classmethod
    def _duration(cls, value: object) -> object:
        return parse_duration(value) if isinstance(value, str) and value.strip() else None

    @field_validator("retention")
    @classmethod
    def _long_enough(cls, value: timedelta | None) -> timedelta | None:
        # A retention of minutes is a typo far more often than a wish (30s meant as 30d): it
        # would delete every finished instance within a minute, so it stops the service.
        if value is not None and value < MIN_RETENTION:
            raise ValueError(
                f"{value.total_seconds():g} seconds is shorter than the 1 hour a retention must"
                " keep at least (did you mean days, e.g. 30d?); to delete sooner, run"
                " `steprecord prune --older-than DURATION` yourself"
            )
        return value

    @field_validator("long_running_after", mode="before")
    @classmethod
    def _long_running(cls, value: object) -> object:
        return parse_duration(value) if isinstance(value, str) else value

    @field_validator("trace_url")
    @classmethod
    def _trace_template(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if "{trace_id}" not in value:
            raise ValueError(
                f"{value!r} has no {{trace_id}}: write the URL of a trace with {{trace_id}} where"
                " its id goes, e.g. https://jaeger.example/trace/{trace_id}"
            )
        return value.strip()


MIN_RETENTION = timedelta(hours=1)
DURATION = re.compile(r"([1-9][0-9]{0,8})([smhdw])")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str) -> timedelta:
    """`90s`, `15m`, `12h`, `30d`, `2w`: a whole number and one unit."""
    match = DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: write a whole number and a unit, s, m, h, d or w"
            " (e.g. 90s, 12h, 30d)"
        )
    return timedelta(**{UNITS[match[2]]: int(match[1])})


SECRET_PARAMETERS = ("password", "sslpassword")


def redact(conninfo: str) -> str:
    """The connection string as `key=value` pairs with every secret replaced by `***`.

    libpq parses it (URL userinfo, URL query parameters, `key=value` pairs, percent escapes
    alike), and the result is rebuilt from the parsed pairs, so no part of the original text
    can carry a secret through.
    """
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "(a connection string libpq cannot parse)"
    for key in SECRET_PARAMETERS:
        if key in params:
            params[key] = "***"
    return make_conninfo("", **params)


@functools.lru_cache(maxsize=256)  # asked on every request, for a handful of local addresses
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, as a dual-stack socket reports it
    return address.is_loopback
