"""What a person with curl meets first: the command's help and errors, and messages that say
what to do."""

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from pydantic import AliasChoices

from app.cli import main
from app.config import Settings
from tests.conftest import ROOT


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on which something else already listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_busy_port_names_the_port_and_never_claims_to_listen(
    busy_port: int, database_url: str, workers: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(busy_port), "--workers", workers],
        env={**os.environ, "DATABASE_URL": database_url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"port {busy_port} is already in use" in done.stderr
    assert "--port" in done.stderr
    assert "listening" not in done.stderr


def test_serve_help_shows_the_defaults_and_every_environment_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "(default: 127.0.0.1)" in text
    assert "(default: 8000)" in text
    assert "(default: 1)" in text
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        variable = alias.choices[0] if isinstance(alias, AliasChoices) else None
        assert str(variable or f"STEPRECORD_{name.upper()}") in text
    assert re.search(r"STEPRECORD_POOL_SIZE +default: 10\n", text)
