"""A dag whose one task writes its process id to `STATE_DIR/pid` and sleeps: the test kills that
process with `kill -9` (under `dag.test()` the dag run and the task share it)."""

import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import DAG, task

STATE = Path(os.environ["STATE_DIR"])

with DAG("killed", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:

    @task
    def sleeper() -> None:
        (STATE / "pid").write_text(str(os.getpid()))
        time.sleep(300)

    sleeper()


if __name__ == "__main__":
    dag.test()
