"""No one token takes every database connection: beyond its share of a worker's pool its
requests wait briefly, then get 429 `token_busy` with `Retry-After`, while another token's
requests go on (see docs/operations.md, Security)."""

import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import psycopg

from tests.helpers import eventually, lock_waits, node_of, problem, start_server, steprecord, stop
from tests.test_faults import FreezableProxy, upstream

# A pool of 4, so the default share is 2; statements may wait on a lock for long.
ENV = {"STEPRECORD_POOL_SIZE": "4", "STEPRECORD_STATEMENT_TIMEOUT": "60"}
FLOOD = 12

Watcher = psycopg.Connection[tuple[Any, ...]]


def create_token(database_url: str, name: str) -> str:
    done = steprecord(database_url, "token", "create", name, "--scope", "write")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def client(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_a_token_flooding_the_pool_gets_429_while_another_tokens_requests_go_on(
    own_database: str,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    flooding = create_token(own_database, f"flood-{suffix}")
    calm = create_token(own_database, f"calm-{suffix}")
    key, other_key = f"flood-{suffix}", f"calm-{suffix}"
    # The blocked writes wait where the record is: the server, or on Citus its worker.
    watcher: Watcher = psycopg.connect(node_of(own_database, key), autocommit=True)
    url, proc = start_server(own_database, env=ENV)
    try:
        with client(url, flooding) as flood, client(url, calm) as other:
            steps = f"/v1/instances/{key}/steps/a"
            assert flood.post(f"{steps}/start", json={"attempt": 1}).status_code == 201
            with psycopg.connect(own_database) as holder, ThreadPoolExecutor(FLOOD) as threads:
                holder.execute(  # by the instance's id: Citus locks rows of one shard only
                    "SELECT r.id FROM workflow_step_record r JOIN process_instance p"
                    " ON p.id = r.instance_id WHERE p.id = steprecord_instance_id(%s)"
                    " AND r.instance_id = steprecord_instance_id(%s) AND p.instance_key = %s"
                    " FOR UPDATE OF r",
                    (key, key, key),
                )
                body = {"attempt": 1, "output": {"n": 1}}
                sent: list[Future[httpx.Response]] = [
                    threads.submit(flood.post, f"{steps}/complete", json=body) for _ in range(FLOOD)
                ]
                try:
                    # Its share, two connections, waits on the lock; the rest of its
                    # requests wait for the share, not for the pool.
                    eventually(lambda: lock_waits(watcher) >= 2, what="blocked writes")
                    for n in range(5):
                        path = f"/v1/instances/{other_key}/steps/s{n}/start"
                        assert other.post(path, json={"attempt": 1}).status_code == 201
                        read = other.get(f"/v1/instances/{other_key}/steps")
                        assert read.status_code == 200, read.text
                        assert len(read.json()["items"]) == n + 1
                    eventually(
                        lambda: sum(f.done() for f in sent) == FLOOD - 2,
                        what="the requests beyond the share answered",
                    )
                    assert lock_waits(watcher) == 2
                    for busy in [f.result() for f in sent if f.done()]:
                        found = problem(busy, 429, "token_busy")
                        assert busy.headers["Retry-After"] == "1"
                        assert "STEPRECORD_POOL_SHARE_PER_TOKEN" in found["detail"]
                finally:
                    holder.rollback()  # the lock goes: the two blocked writes complete
                answers = sorted(f.result().status_code for f in sent)
            assert answers == [200, 200] + [429] * (FLOOD - 2)
            assert flood.get(steps).json()["status"] == "completed"
    finally:
        watcher.close()
        stop(proc)


def test_a_token_whose_connections_cannot_open_gets_503_not_429(own_database: str) -> None:
    """Its share is not busy with its own statements: the database is out, and says so."""
    secret = create_token(own_database, f"outage-{uuid.uuid4().hex[:8]}")
    with FreezableProxy(upstream(own_database)) as proxy:
        env = ENV | {"STEPRECORD_STATEMENT_TIMEOUT": "1", "STEPRECORD_SWEEP_SECONDS": "0"}
        url, proc = start_server(proxy.url(own_database), env=env)
        try:
            with client(url, secret) as answering:
                assert answering.get("/v1/instances").status_code == 200
            proxy.freeze()
            with client(url, secret) as frozen, ThreadPoolExecutor(FLOOD) as threads:
                answers = list(threads.map(lambda _: frozen.get("/v1/instances"), range(FLOOD)))
            for answer in answers:
                problem(answer, 503, "unavailable")
        finally:
            stop(proc)
