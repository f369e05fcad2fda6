"""The service's processes: the steprecord command, servers on free ports, PgBouncer."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.support import ROOT


def steprecord(database_url: str, *args: str, **run: Any) -> subprocess.CompletedProcess[str]:
    """The `steprecord` command on `database_url`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env={**os.environ, "DATABASE_URL": database_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **run,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server started by `start_server`, and whatever of its process group is left: a
    worker whose supervisor died before it would otherwise run on, orphaned."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def start_server(
    database_url: str,
    *extra: str,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *extra],
        env={**os.environ, **(env or {}), "DATABASE_URL": database_url},
        cwd=ROOT,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,  # its own process group, workers included: see `stop`
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except BaseException:
        stop(proc)
        raise
    return url, proc


# What a service behind the PgBouncer below needs: no server-side prepared statements, which
# PgBouncer before 1.21 (Debian 12 has 1.18) does not carry across transactions.
BEHIND_PGBOUNCER = {"STEPRECORD_PREPARE_THRESHOLD": "none"}


@contextmanager
def logged_server(
    database_url: str, log: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`start_server` with its stdout (the JSON log lines) written to `log`; yields its URL
    and stops it on the way out."""
    with log.open("wb") as out:
        url, proc = start_server(database_url, *extra, env=env, stdout=out)
    try:
        yield url
    finally:
        stop(proc)


@contextmanager
def pgbouncer(database_url: str) -> Iterator[str]:
    """PgBouncer in transaction pool mode in front of the database; yields its URL. Stopped,
    and its working directory removed, on the way out."""
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    workdir = Path(tempfile.mkdtemp(prefix="steprecord-pgbouncer-"))
    if os.geteuid() == 0:  # PgBouncer will not run as root; it switches to nobody
        shutil.chown(workdir, "nobody")
    port = free_port()
    ini = workdir / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"* = host={info.get('host', '127.0.0.1')} port={info.get('port', 5432)} user=postgres\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = transaction\n"
        "max_client_conn = 500\ndefault_pool_size = 20\n"
        f"logfile = {workdir}/pgbouncer.log\npidfile = {workdir}/pgbouncer.pid\n"
    )
    ini.chmod(0o644)
    command = ["pgbouncer", *(["-u", "nobody"] if os.geteuid() == 0 else []), str(ini)]
    proc = subprocess.Popen(command, cwd=workdir)
    url = psycopg.conninfo.make_conninfo(
        "", host="127.0.0.1", port=port, user="postgres", dbname=str(info["dbname"])
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
