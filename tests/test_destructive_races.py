"""Destructive paths decide on what is committed when they decide: a prune or a `DELETE` that
waited for an instance's lock judges the instance again after it got the lock, so a step
created meanwhile is seen (and keeps the instance, or is judged with it), and the race never
answers 5xx.

Each test plays the writer itself: one transaction runs the judge's own function, which locks
the instance and creates a step, and stays open until the destructive path is seen waiting
for that lock (pg_stat_activity), then commits. On Citus that transaction runs on the worker
holding the instance: Citus sends the judge's function to its worker only when it is called
alone, outside a transaction block.
"""

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest

from tests.support import ROOT
from tests.support.citus import node_of
from tests.support.databases import lock_waits
from tests.support.http import T1, T2, exists, post
from tests.support.rows import age
from tests.support.waits import wait_for

# The judge's function for one event (app/sql/apply_event.sql): the fields in its order.
CREATE_STEP = (
    "SELECT outcome FROM steprecord_apply_event(steprecord_instance_id(%(instance)s), 0,"
    " %(instance)s, %(step)s, %(kind)s, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
)


@contextmanager
def step_created_in_open_transaction(
    database_url: str, instance: str, step: str, kind: str
) -> Iterator[psycopg.Connection[Any]]:
    """A transaction that has locked `instance` and created `step` in it, not yet committed;
    the test commits it (or it is rolled back on the way out)."""
    with psycopg.connect(node_of(database_url, instance)) as writer:
        row = writer.execute(
            CREATE_STEP, {"instance": instance, "step": step, "kind": kind}
        ).fetchone()
        assert row == ("created",)
        try:
            yield writer
        finally:
            writer.rollback()


def waits_for_lock(watcher: psycopg.Connection[Any]) -> bool:
    return lock_waits(watcher) >= 1


def test_a_step_created_while_a_prune_waited_keeps_its_instance(
    client: httpx.Client, database_url: str
) -> None:
    post(client, "complete", {"started_at": T1, "completed_at": T2}, instance="old")
    age(database_url, "old", 3)
    with (
        psycopg.connect(database_url, autocommit=True) as watcher,
        step_created_in_open_transaction(database_url, "old", "late", "declare") as writer,
    ):
        prune = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "prune", "--older-than", "1d"],
            env={**os.environ, "DATABASE_URL": database_url},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for("the prune to wait for the instance's lock", lambda: waits_for_lock(watcher))
            writer.commit()
            out, err = prune.communicate(timeout=60)
        finally:
            if prune.poll() is None:
                prune.kill()
                prune.communicate()
    assert prune.returncode == 0, err
    assert "deleted 0 instances" in out, out
    assert client.get("/v1/instances/old/steps/late").json()["status"] == "pending"
    assert exists(client, "old")


def test_a_running_step_created_while_a_delete_waited_makes_it_a_409(
    client: httpx.Client, database_url: str
) -> None:
    post(client, "complete", {"started_at": T1, "completed_at": T2}, instance="busy")
    answers: list[httpx.Response] = []
    with (
        psycopg.connect(database_url, autocommit=True) as watcher,
        step_created_in_open_transaction(database_url, "busy", "late", "start") as writer,
    ):
        deleter = threading.Thread(
            target=lambda: answers.append(client.delete("/v1/instances/busy"))
        )
        deleter.start()
        try:
            wait_for("the DELETE to wait for the instance's lock", lambda: waits_for_lock(watcher))
            writer.commit()
        finally:
            deleter.join(60)
    (answer,) = answers
    assert answer.status_code == 409, answer.text
    assert answer.json()["code"] == "instance_active"
    assert client.get("/v1/instances/busy/steps/late").json()["status"] == "running"


@pytest.mark.parametrize("force", ["false", "true"])
def test_a_delete_racing_a_new_pending_step_deletes_it_with_its_instance(
    client: httpx.Client, database_url: str, force: str
) -> None:
    """Judged under the lock, the new step is part of what goes: 204, never a 500 from the
    step's row still pointing at the instance."""
    post(client, "complete", {"started_at": T1, "completed_at": T2}, instance="done")
    answers: list[httpx.Response] = []
    with (
        psycopg.connect(database_url, autocommit=True) as watcher,
        step_created_in_open_transaction(database_url, "done", "late", "declare") as writer,
    ):

        def delete() -> None:
            answers.append(client.delete("/v1/instances/done", params={"force": force}))

        deleter = threading.Thread(target=delete)
        deleter.start()
        try:
            wait_for("the DELETE to wait for the instance's lock", lambda: waits_for_lock(watcher))
            writer.commit()
        finally:
            deleter.join(60)
    (answer,) = answers
    assert answer.status_code == 204, answer.text
    assert not exists(client, "done")


@pytest.mark.parametrize("kind", ["declare", "start"])
def test_a_write_that_waited_for_a_delete_starts_a_new_instance(
    client: httpx.Client, database_url: str, kind: str
) -> None:
    """The other side of the race: a write that waited behind a `DELETE` (here the DELETE's
    own two statements, run by hand) finds its instance gone and creates a new one: 201."""
    post(client, "complete", {"started_at": T1, "completed_at": T2}, instance="gone")
    answers: list[httpx.Response] = []
    with (
        psycopg.connect(database_url, autocommit=True) as watcher,
        psycopg.connect(database_url) as deleter,
    ):
        # As the DELETE's lock does, by the key's id too (on Citus: on the worker holding it).
        (instance_id,) = deleter.execute(
            "SELECT id FROM process_instance"
            " WHERE id = steprecord_instance_id('gone') AND instance_key = 'gone' FOR UPDATE"
        ).fetchone() or (None,)
        writer = threading.Thread(
            target=lambda: answers.append(client.post(f"/v1/instances/gone/steps/new/{kind}"))
        )
        writer.start()
        try:
            wait_for("the write to wait for the instance's lock", lambda: waits_for_lock(watcher))
            deleter.execute(
                "DELETE FROM workflow_step_record WHERE instance_id = %s", (instance_id,)
            )
            deleter.execute("DELETE FROM process_instance WHERE id = %s", (instance_id,))
            deleter.commit()
        finally:
            writer.join(60)
    (answer,) = answers
    assert answer.status_code == 201, answer.text
    steps = client.get("/v1/instances/gone/steps").json()["items"]
    assert [step["step_slug"] for step in steps] == ["new"]
