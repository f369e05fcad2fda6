"""Streams under hostile use: a revoked token's open streams end within a few seconds, a
stream lives at most `STEPRECORD_STREAM_MAX_SECONDS`, a token holds at most
`STEPRECORD_STREAMS_PER_TOKEN` streams per worker (then 429 `too_many_streams`), and an idle
stream reads nothing from the database at its keepalives."""

from collections.abc import Iterator

import httpx
import pytest

from tests.support.databases import migrated_database
from tests.support.http import problem
from tests.support.metrics import counter
from tests.support.servers import start_server, steprecord, stop
from tests.support.streams import WAIT, Event, Stream
from tests.support.tokens import bearer, create_token
from tests.support.waits import eventually

PER_TOKEN = 3


@pytest.fixture(scope="module")
def guarded(server_dsn: str) -> Iterator[tuple[str, str]]:
    """A server of the module's own with tokens, reloaded often, quick keepalives, and few
    streams per token: (its URL, its database)."""
    with migrated_database(server_dsn, "steprecord_stream_limits_") as url:
        env = {
            "STEPRECORD_TOKEN_REFRESH_SECONDS": "0.2",
            "STEPRECORD_STREAM_HEARTBEAT_SECONDS": "0.2",
            "STEPRECORD_STREAMS_PER_TOKEN": str(PER_TOKEN),
        }
        create_token(url, "setup", "write")  # tokens exist before the server starts
        base, proc = start_server(url, env=env)
        try:
            yield base, url
        finally:
            stop(proc)


def test_revoking_a_token_ends_its_open_streams_within_seconds(
    guarded: tuple[str, str],
) -> None:
    base, url = guarded
    writer = bearer(create_token(url, "revoke-writer", "write"))
    reader = create_token(url, "revoke-reader", "read")
    with httpx.Client(base_url=base, timeout=WAIT, headers=writer) as client:
        assert client.post("/v1/instances/revoked/steps/a/declare").status_code == 201
        stream = Stream(f"{base}/v1/instances/revoked/stream", headers=bearer(reader))
        try:
            stream.next_event()
            assert steprecord(url, "token", "revoke", "revoke-reader").returncode == 0
            eventually(stream.ended, 5, what="the revoked token's stream to end")
            # Whatever is written after the revocation never reaches it.
            assert client.post("/v1/instances/revoked/steps/b/declare").status_code == 201
            left = [item for item in list(stream.items.queue) if isinstance(item, Event)]
            assert [event.record["step_slug"] for event in left if event.record] == []
        finally:
            stream.close()
        reopened = httpx.get(f"{base}/v1/instances/revoked/stream", headers=bearer(reader))
        problem(reopened, 401, "unauthorized")


def test_a_token_holds_a_bounded_number_of_streams_per_worker(
    guarded: tuple[str, str],
) -> None:
    base, url = guarded
    token = create_token(url, "greedy", "write")
    other = create_token(url, "modest", "read")
    path = f"{base}/v1/instances/many/stream"
    assert httpx.post(f"{base}/v1/instances/many/steps/a/declare", headers=bearer(token)).is_success
    streams = [Stream(path, headers=bearer(token)) for _ in range(PER_TOKEN)]
    try:
        with httpx.stream("GET", path, headers=bearer(token), timeout=WAIT) as refused:
            assert refused.status_code == 429  # (an open stream would be a 200)
            refused.read()
        body = problem(refused, 429, "too_many_streams")
        assert "STEPRECORD_STREAMS_PER_TOKEN" in body["detail"]
        assert refused.headers["Retry-After"].isdigit()
        # Another token is not held back by it.
        Stream(path, headers=bearer(other)).close()
        # A closed stream frees its place.
        streams.pop().close()
        streams.append(Stream(path, headers=bearer(token)))
    finally:
        for stream in streams:
            stream.close()


def test_an_idle_stream_reads_nothing_at_its_keepalives(guarded: tuple[str, str]) -> None:
    base, url = guarded
    token = bearer(create_token(url, "idle", "write"))
    assert httpx.post(f"{base}/v1/instances/idle/steps/a/declare", headers=token).is_success
    stream = Stream(f"{base}/v1/instances/idle/stream", headers=token)
    try:
        stream.next_event()
        stream.quiet(keepalives=2)  # settled: the listener listens, the first reads are done
        before = counter(metrics_of(base, token), "steprecord_reads_total", pool="primary")
        stream.quiet(keepalives=10)
        after = counter(metrics_of(base, token), "steprecord_reads_total", pool="primary")
        assert after == before, f"{after - before} reads in 10 keepalives of an idle stream"
        # and it still gets what is written
        assert httpx.post(f"{base}/v1/instances/idle/steps/b/declare", headers=token).is_success
        assert stream.next_event().record["step_slug"] == "b"
    finally:
        stream.close()


def metrics_of(base: str, headers: dict[str, str]) -> str:
    response = httpx.get(f"{base}/metrics", headers=headers, timeout=WAIT)
    assert response.status_code == 200, response.text
    return response.text


def test_a_stream_ends_after_its_maximum_lifetime(server_dsn: str) -> None:
    with migrated_database(server_dsn, "steprecord_stream_lifetime_") as url:
        env = {"STEPRECORD_STREAM_MAX_SECONDS": "1", "STEPRECORD_STREAM_HEARTBEAT_SECONDS": "0.2"}
        base, proc = start_server(url, env=env)
        try:
            httpx.post(f"{base}/v1/instances/short/steps/a/declare", timeout=WAIT)
            stream = Stream(f"{base}/v1/instances/short/stream")
            try:
                stream.next_event()
                eventually(stream.ended, 5, what="the stream to end at its maximum lifetime")
            finally:
                stream.close()
        finally:
            stop(proc)
