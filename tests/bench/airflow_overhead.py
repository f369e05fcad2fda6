"""What the Airflow plugin costs a worker per task try: the time spent in its hooks.

Run with the Python of a virtualenv holding Airflow 3.3 and this client (the one `.ci/run`
makes, `.venv-airflow`), against a service already running:

    .venv-airflow/bin/python tests/bench/airflow_overhead.py --url http://127.0.0.1:8000

It makes an Airflow home of its own (SQLite) in a temporary directory, then runs with
`dag.test()` a dag of one mapped task of `--tries` trivial tries, and times, for each try,
the plugin's hooks as the task runner calls them: `on_task_instance_running` (queues the
start, starts the heartbeat thread), `on_task_instance_success` (queues the complete) and
`before_stopping` (waits until this try's reports were delivered, at most `flush_seconds`).
Their sum is what a worker's task process spends on recording one try; it prints the p50,
p90, p99 and max of that sum, and the same for each hook.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DAG_FILE = """
from datetime import datetime

from airflow.sdk import DAG, task

with DAG("overhead", schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:

    @task
    def items():
        return list(range(TRIES))

    @task
    def noop(x):
        return x

    noop.expand(x=items())
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the steprecord service")
    parser.add_argument("--token", default=None)
    parser.add_argument("--tries", type=int, default=200)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="airflow-bench-"))
    os.environ.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__STEPRECORD__URL=args.url,
        AIRFLOW__STEPRECORD__CLOSE_AFTER_SECONDS="0",
    )
    if args.token:
        os.environ["AIRFLOW__STEPRECORD__TOKEN"] = args.token
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True)

    from steprecord_client import airflow as plugin

    spent: dict[str, list[float]] = {"running": [], "success": [], "stopping": []}

    def timed(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def wrapper(*a: Any, **kw: Any) -> Any:
            began = time.perf_counter()
            try:
                return hook(*a, **kw)
            finally:
                spent[name].append(time.perf_counter() - began)

        return wrapper

    listener: Any = plugin.listener
    listener.on_task_instance_running = timed("running", listener.on_task_instance_running)
    listener.on_task_instance_success = timed("success", listener.on_task_instance_success)
    listener.before_stopping = timed("stopping", listener.before_stopping)

    # dag.test() runs a dag of the dags folder: this one, written there.
    dags = home / "dags"
    dags.mkdir()
    (dags / "overhead.py").write_text(DAG_FILE.replace("TRIES", str(args.tries)))
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(dags)
    sys.path.insert(0, str(dags))
    dag = importlib.import_module("overhead").dag
    tries = args.tries

    began = time.monotonic()
    dag.test()
    took = time.monotonic() - began
    listener.flush(30)

    count = min(len(v) for v in spent.values())
    per_try = [sum(spent[name][i] for name in spent) for i in range(count)]
    print(f"{count} tries in {took:.1f} s (dag.test() of {tries + 1} task instances)")
    rows = [("per try (all hooks)", per_try)] + [(f"  {n}", v[:count]) for n, v in spent.items()]
    for label, values in rows:
        ms = [v * 1000 for v in values]
        print(
            f"{label:22s} p50 {percentile(ms, 0.5):7.2f} ms  p90 {percentile(ms, 0.9):7.2f} ms"
            f"  p99 {percentile(ms, 0.99):7.2f} ms  max {max(ms):7.2f} ms"
            f"  mean {statistics.fmean(ms):7.2f} ms"
        )


if __name__ == "__main__":
    main()
