"""No one token takes every database connection: beyond its share of a worker's pool its
requests wait briefly, then get 429 `token_busy` with `Retry-After`, while another token's
requests go on (see docs/operations.md, Security)."""

import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import psycopg

from tests.support.citus import node_of
from tests.support.databases import lock_waits
from tests.support.http import problem
from tests.support.proxy import FreezableProxy, upstream
from tests.support.servers import start_server, steprecord, stop
from tests.support.tokens import create_token
from tests.support.waits import eventually

# A pool of 4, so the default share is 2; statements may wait on a lock for long.
ENV = {"STEPRECORD_POOL_SIZE": "4", "STEPRECORD_STATEMENT_TIMEOUT": "60"}
FLOOD = 12

Watcher = psycopg.Connection[tuple[Any, ...]]


def client(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_a_token_flooding_the_pool_gets_429_while_another_tokens_requests_go_on(
    own_database: str,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    flooding = create_token(own_database, f"flood-{suffix}", "write")
    calm = create_token(own_database, f"calm-{suffix}", "write")
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
    secret = create_token(own_database, f"outage-{uuid.uuid4().hex[:8]}", "write")
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


def create_tenant_token(database_url: str, name: str, prefix: str) -> str:
    done = steprecord(database_url, "token", "create", name, "--scope", "write", "--prefix", prefix)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


LOCK_RECORD = (
    "SELECT r.id FROM workflow_step_record r JOIN process_instance p"
    " ON p.id = r.instance_id WHERE p.id = steprecord_instance_id(%s)"
    " AND r.instance_id = steprecord_instance_id(%s) AND p.instance_key = %s"
    " FOR UPDATE OF r"
)


def flood_locked(
    database_url: str,
    url: str,
    flooders: list[tuple[str, str]],
    calm: str,
    calm_key: str,
    *,
    blocked: int,
) -> list[httpx.Response]:
    """Each (token, key) of `flooders` sends `FLOOD` writes to its key's record, which a
    transaction of the test holds locked; once `blocked` of them wait on the lock, the `calm`
    token writes and reads five times, each answered at once. The flooders' answers."""
    watcher: Watcher = psycopg.connect(node_of(database_url, flooders[0][1]), autocommit=True)
    clients = [client(url, token) for token, _ in flooders]
    try:
        for (_, key), flooder in zip(flooders, clients, strict=True):
            steps = f"/v1/instances/{key}/steps/a"
            assert flooder.post(f"{steps}/start", json={"attempt": 1}).status_code == 201
        with (
            psycopg.connect(database_url) as holder,
            ThreadPoolExecutor(FLOOD * len(flooders)) as threads,
            client(url, calm) as other,
        ):
            for _, key in flooders:
                holder.execute(LOCK_RECORD, (key, key, key))
            body = {"attempt": 1, "output": {"n": 1}}
            sent = [
                threads.submit(flooder.post, f"/v1/instances/{key}/steps/a/complete", json=body)
                for (_, key), flooder in zip(flooders, clients, strict=True)
                for _ in range(FLOOD)
            ]
            try:
                eventually(lambda: lock_waits(watcher) >= blocked, what="blocked writes")
                for n in range(5):
                    path = f"/v1/instances/{calm_key}/steps/s{n}/start"
                    assert other.post(path, json={"attempt": 1}).status_code == 201
                    read = other.get(f"/v1/instances/{calm_key}/steps")
                    assert read.status_code == 200, read.text
                eventually(
                    lambda: sum(f.done() for f in sent) == len(sent) - blocked,
                    what="the requests beyond the blocked ones answered",
                )
                assert lock_waits(watcher) == blocked
            finally:
                holder.rollback()
            return [f.result() for f in sent]
    finally:
        for flooder in clients:
            flooder.close()
        watcher.close()


def keys_on_one_node(url: str, keys: list[str]) -> list[str]:
    """`keys`, each after the first given a suffix `-N` where needed so that all live on the
    first one's node: on Citus the service keeps a pool per node, each with its own shares,
    and the tests below flood one pool."""
    node = node_of(url, keys[0])
    found = [keys[0]]
    for key in keys[1:]:
        candidate, n = key, 0
        while node_of(url, candidate) != node:
            n += 1
            candidate = f"{key}-{n}"
        found.append(candidate)
    return found


def test_two_tokens_of_one_tenant_share_its_part_of_the_pool_and_another_tenant_goes_on(
    own_database: str,
) -> None:
    """Tokens of one key prefix together hold at most the tenant's share (half the pool of 4
    by default): their requests beyond get 429 naming STEPRECORD_POOL_SHARE_PER_TENANT."""
    suffix = uuid.uuid4().hex[:8]
    tenant = f"acme-{suffix}:"
    first = create_tenant_token(own_database, f"acme-a-{suffix}", tenant)
    second = create_tenant_token(own_database, f"acme-b-{suffix}", tenant)
    calm = create_tenant_token(own_database, f"globex-{suffix}", f"globex-{suffix}:")
    url, proc = start_server(own_database, env=ENV)
    try:
        one, two, calm_key = keys_on_one_node(
            own_database, [f"{tenant}one", f"{tenant}two", f"globex-{suffix}:calm"]
        )
        flooders = [(first, one), (second, two)]
        answers = flood_locked(own_database, url, flooders, calm, calm_key, blocked=2)
    finally:
        stop(proc)
    assert sorted(a.status_code for a in answers) == [200, 200] + [429] * (2 * FLOOD - 2)
    details = [problem(a, 429, "token_busy")["detail"] for a in answers if a.status_code == 429]
    assert any("STEPRECORD_POOL_SHARE_PER_TENANT" in detail for detail in details)


def test_two_busy_tokens_leave_the_reserve_to_a_third(own_database: str) -> None:
    """A pool of 4 with shares of 2: two flooding tokens take 3 connections, not 4; the
    last (STEPRECORD_POOL_RESERVE, 1 by default) goes only to a token holding none."""
    suffix = uuid.uuid4().hex[:8]
    first = create_token(own_database, f"busy-a-{suffix}", "write")
    second = create_token(own_database, f"busy-b-{suffix}", "write")
    calm = create_token(own_database, f"third-{suffix}", "write")
    url, proc = start_server(own_database, env=ENV)
    try:
        one, two, calm_key = keys_on_one_node(
            own_database, [f"busy-a-{suffix}", f"busy-b-{suffix}", f"third-{suffix}"]
        )
        flooders = [(first, one), (second, two)]
        answers = flood_locked(own_database, url, flooders, calm, calm_key, blocked=3)
    finally:
        stop(proc)
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(200) == 3
    assert set(statuses) <= {200, 429, 503}
