"""A Celery shop whose every task is recorded in steprecord: a chain with a retrying task.

Run it (a steprecord service, RabbitMQ and Redis on this machine)::

    pip install './clients/python[celery]' 'celery[redis]'
    steprecord serve                                   # terminal 1: http://127.0.0.1:8000
    cd clients/python/examples
    celery -A celery_shop worker --loglevel INFO       # terminal 2 (add --pool threads or solo)
    python celery_shop.py                              # terminal 3: sends one order's chain

Then open http://127.0.0.1:8000/ui: the instance is the chain's first task id, with one
step per task — `charge` shows two failed attempts (`GatewayTimeout`) and a completed third.

Settings (environment): `SHOP_BROKER` (default `amqp://guest:guest@127.0.0.1:5672//`),
`SHOP_BACKEND` (default `redis://127.0.0.1:6379/0`), `SHOP_QUEUE` (default `shop`: the
queue the orders go to and the worker consumes), `STEPRECORD_URL` (default
`http://127.0.0.1:8000`) and `STEPRECORD_TOKEN` (a write token, when the service has tokens).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, Task, chain

from steprecord_client.celery import record_celery

app = Celery(
    "shop",
    broker=os.environ.get("SHOP_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
    backend=os.environ.get("SHOP_BACKEND", "redis://127.0.0.1:6379/0"),
)
app.conf.update(
    task_acks_late=True,  # keep the message until the task has finished ...
    task_reject_on_worker_lost=True,  # ... and give it back when the worker dies
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("SHOP_QUEUE", "shop"),
)
record_celery(
    app,
    os.environ.get("STEPRECORD_URL", "http://127.0.0.1:8000"),
    token=os.environ.get("STEPRECORD_TOKEN"),
    lease_seconds=60,
)


class GatewayTimeout(Exception):
    """The payment gateway did not answer in time."""


# Each task is named explicitly: the worker imports this file as the module `celery_shop`,
# while `python celery_shop.py` runs it as `__main__`, and Celery would name the tasks after
# each (`celery_shop.reserve` in the worker, `shop.reserve` in the sender), so the worker
# would refuse the sender's messages as unregistered.
@app.task(name="shop.reserve")
def reserve(order_id: str, items: list[str]) -> dict[str, Any]:
    return {"order_id": order_id, "items": items, "reservation": f"res-{order_id}"}


@app.task(name="shop.charge", bind=True, max_retries=3)
def charge(self: Task[Any, Any], order: dict[str, Any]) -> dict[str, Any]:
    if self.request.retries < 2:  # the gateway times out twice, then answers
        exc = GatewayTimeout(f"gateway timed out (try {self.request.retries + 1})")
        raise self.retry(exc=exc, countdown=1)
    return {**order, "charge_id": f"ch-{order['order_id']}"}


@app.task(name="shop.ship")
def ship(order: dict[str, Any]) -> str:
    return f"parcel for {order['order_id']} ({order['charge_id']})"


if __name__ == "__main__":
    result = chain(reserve.s("order-123", ["book", "lamp"]), charge.s(), ship.s())()

    print(result.get(timeout=60))
