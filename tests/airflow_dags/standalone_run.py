"""The dag tests/test_airflow.py triggers in `airflow standalone` (LocalExecutor): each task runs
in a task process of its own, as in production. A retried task, a mapped task, a sensor in
reschedule mode (each poke a process of its own) and a task that writes its process id to
`STATE_DIR/pid` and sleeps until the test kills it with `kill -9`."""

import os
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.providers.standard.sensors.python import PythonSensor
from airflow.sdk import DAG, task

STATE = Path(os.environ["STATE_DIR"])


def count(name: str) -> int:
    path = STATE / name
    seen = int(path.read_text()) if path.exists() else 0
    path.write_text(str(seen + 1))
    return seen


with DAG("standalone_run", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:

    @task(retries=1, retry_delay=timedelta(seconds=0))
    def flaky() -> str:
        if count("flaky") < 1:
            raise ValueError("the first try fails")
        return "ok"

    @task
    def items() -> list[int]:
        return [0, 1, 2]

    @task
    def load(x: int) -> int:
        return x

    wait = PythonSensor(
        task_id="wait",
        python_callable=lambda: count("pokes") >= 1,
        mode="reschedule",
        # Not shorter: a LocalExecutor worker reports a finished workload up to
        # `[workers] min_heartbeat_interval` (5 s) late, and Airflow 3.3 fails a sensor whose
        # next poke was queued before that report arrived ("finished with state success,
        # but the task instance's state attribute is queued").
        poke_interval=15,
        timeout=120,
    )

    # First in the queue (the others weigh 1 or 2): the test kills it as soon as it runs,
    # whatever else is still waiting for one of the two slots.
    @task(priority_weight=100, weight_rule="absolute")
    def sleeper() -> None:
        (STATE / "pid").write_text(str(os.getpid()))
        time.sleep(600)

    flaky()
    load.expand(x=items())
    wait  # noqa: B018  (a task on its own)
    sleeper()
