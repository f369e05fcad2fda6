"""RabbitMQ and Redis, which the Celery tests need."""

import os
import socket

import pytest


def require_celery_services() -> None:
    """Skip (fail in CI) unless RabbitMQ (the broker) and Redis (the results) answer on
    127.0.0.1, as every Celery test needs them."""

    def answers(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    missing = [name for name, port in (("RabbitMQ", 5672), ("Redis", 6379)) if not answers(port)]
    if missing:
        reason = f"{' and '.join(missing)} not answering on 127.0.0.1: Celery tests need them"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
