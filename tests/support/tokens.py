"""API tokens: what each worker of a server enforces."""

import json
from pathlib import Path


def access_loaded(log: Path, workers: int, tokens: int, *, anonymous: bool = False) -> bool:
    """Whether every worker of a server logging to `log` now enforces `tokens` active tokens
    and that anonymous policy: each worker logs a line whenever its view of access changes,
    so its last such line is what it enforces."""
    latest: dict[int, tuple[int, bool]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if "active_tokens" in entry:
            latest[entry["worker"]] = (entry["active_tokens"], entry["anonymous_allowed"])
    return len(latest) == workers and set(latest.values()) == {(tokens, anonymous)}
