"""Racing requests through the real HTTP stack: the database serialises them."""

import asyncio
import random
import threading
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from app.data import judge
from tests.support.citus import has_citus
from tests.support.http import T1, T2, step_path


async def race(server_url: str, requests: list[tuple[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=server_url, limits=limits, timeout=60) as client:
        return await asyncio.gather(*(client.post(url, json=body) for url, body in requests))


def test_concurrent_bare_starts_take_attempts_one_to_n_on_one_row(
    server_url: str, database_url: str
) -> None:
    responses = asyncio.run(race(server_url, [(f"{step_path()}/start", None)] * 25))
    assert sorted(r.status_code for r in responses) == [200] * 24 + [201]
    assert sorted(r.json()["attempt_count"] for r in responses) == list(range(1, 26))
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT attempt_count FROM workflow_step_record").fetchall()
    assert rows == [(25,)]


def test_concurrent_new_steps_get_distinct_ordinals(server_url: str) -> None:
    requests = [(f"{step_path(step=f's{i}')}/start", None) for i in range(30)]
    responses = asyncio.run(race(server_url, requests))
    assert all(r.status_code == 201 for r in responses)
    assert sorted(r.json()["ordinal"] for r in responses) == list(range(30))


def test_concurrent_new_instances_are_each_created_once(server_url: str, database_url: str) -> None:
    requests = [
        (f"{step_path(instance=f'run-{i % 5}', step=f's{i}')}/declare", None) for i in range(30)
    ]
    responses = asyncio.run(race(server_url, requests))
    assert all(r.status_code == 201 for r in responses)
    with psycopg.connect(database_url) as conn:
        count = conn.execute("SELECT count(*) FROM process_instance").fetchone()
    assert count == (5,)


def test_concurrent_duplicate_events_create_one_record(server_url: str, database_url: str) -> None:
    body = {"attempt": 1, "started_at": T1, "completed_at": T2, "output": {"n": 1}}
    responses = asyncio.run(race(server_url, [(f"{step_path()}/complete", body)] * 20))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 19 + [201]
    assert len({r.json()["updated_at"] for r in responses}) == 1
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT ordinal, status FROM workflow_step_record").fetchall()
        next_ordinal = conn.execute("SELECT next_ordinal FROM process_instance").fetchone()
    assert rows == [(0, "completed")]
    assert next_ordinal == (1,)


def test_racing_creators_of_one_step_do_not_skip_ordinals(
    server_url: str, client: httpx.Client
) -> None:
    for round_ in range(3):
        client.post(f"{step_path(step=f'first{round_}')}/declare")
        body = {"attempt": 1, "started_at": T1}
        asyncio.run(race(server_url, [(f"{step_path(step=f'b{round_}')}/start", body)] * 20))
    client.post(f"{step_path(step='last')}/declare")
    ordinals = [r["ordinal"] for r in client.get("/v1/instances/order-1/steps").json()["items"]]
    assert ordinals == list(range(7))


def declare_overlapping_new_instances(database_url: str, callers: int = 6, rounds: int = 8) -> int:
    """Concurrent calls of one node's batch statement, each declaring steps in a random two
    thirds of the same 30 new instances per round; returns how many calls deadlocked."""
    prefix, keys = uuid.uuid4().hex[:8], 30
    statement = judge.APPLY_EVENTS
    pools = [[f"{prefix}-{r}-{k}" for k in range(keys)] for r in range(rounds)]
    barrier = threading.Barrier(callers)
    deadlocks: list[int] = []
    errors: list[BaseException] = []

    def caller(number: int) -> None:
        rng = random.Random(number)
        try:
            with psycopg.connect(database_url, autocommit=True) as conn:
                for round_ in range(rounds):
                    chosen = rng.sample(pools[round_], 20)
                    n = len(chosen)
                    columns: list[list[Any]] = [list(range(n)), chosen, [f"caller-{number}"] * n]
                    columns += [["declare"] * n] + [[None] * n for _ in range(9)]
                    barrier.wait()
                    try:
                        # The columns, then the trace id (none), the writer, no labels.
                        psycopg.RawCursor(conn).execute(
                            statement, [*columns, None, f"caller-{number}", None]
                        )
                    except psycopg.errors.DeadlockDetected:
                        deadlocks.append(round_)
        except threading.BrokenBarrierError:
            pass  # another caller failed: its error is the one reported
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()  # the others stop at their next round instead of waiting forever

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return len(deadlocks)


def test_concurrent_batches_creating_the_same_instances_do_not_deadlock(database_url: str) -> None:
    """New instances are inserted in key order: overlapping creators wait, never deadlock.
    One node's batch statement: on Citus the service judges a batch event by event, each
    call its own transaction of one instance, which holds no lock another call waits for
    while it waits (tests/test_citus_judge.py races batches there)."""
    if has_citus(database_url):
        pytest.skip("one node's batch statement: Citus judges a batch event by event")
    assert declare_overlapping_new_instances(database_url) == 0
