"""The dag tests/test_airflow.py runs with `dag.test()` in Airflow's own virtualenv: every
shape of try the plugin must record. `STATE_DIR` holds the counters that make tries fail or
pokes wait; `DAG_ID` names it."""

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.exceptions import AirflowSkipException
from airflow.providers.standard.operators.python import BranchPythonOperator
from airflow.providers.standard.sensors.python import PythonSensor
from airflow.sdk import DAG, task

STATE = Path(os.environ["STATE_DIR"])
DAG_ID = os.environ.get("DAG_ID", "recorded")


def count(name: str) -> int:
    """How many times `name` was counted before (and count this once)."""
    path = STATE / name
    seen = int(path.read_text()) if path.exists() else 0
    path.write_text(str(seen + 1))
    return seen


with DAG(DAG_ID, schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:

    @task(retries=3, retry_delay=timedelta(seconds=0), owner="data-team", pool="default_pool")
    def flaky() -> str:
        tried = count("flaky")
        if tried < 2:
            raise ValueError(f"flaky try {tried + 1} failed")
        return "ok"

    @task
    def items() -> list[int]:
        return list(range(20))

    @task
    def load(x: int) -> int:
        return x * 2

    @task
    def nothing_to_do() -> None:
        raise AirflowSkipException("nothing to do today")

    branch = BranchPythonOperator(task_id="branch", python_callable=lambda: "taken")

    @task
    def taken() -> int:
        return 1

    @task
    def not_taken() -> int:
        return 2

    @task(retries=1, retry_delay=timedelta(seconds=0))
    def broken() -> None:
        raise RuntimeError("broken on purpose")

    wait = PythonSensor(
        task_id="wait",
        python_callable=lambda: count("pokes") >= 2,
        mode="reschedule",
        poke_interval=1,
        timeout=120,
    )

    flaky()
    load.expand(x=items())
    nothing_to_do()
    branch >> [taken(), not_taken()]
    broken()
    wait  # noqa: B018  (a task on its own)


if __name__ == "__main__":
    dag.test()
