"""The dashboard shows a Celery task's slug (`<task name>:<task id>`) readably: the task name
and the start of its id (cut to fit), the full slug on hover (`title=`) and on the step page."""

import httpx

from tests.support.http import T0, T1, post

TASK_ID = "5f0c7d6e-2b1a-4c3d-9e8f-0a1b2c3d4e5f"
SLUG = f"shop.tasks.charge:{TASK_ID}"
SHORT = "shop.tasks.charge:5f0c7d6e…"


def page(client: httpx.Client, path: str) -> str:
    response = client.get(path)
    assert response.status_code == 200, response.text
    return response.text


def test_the_instance_page_shows_a_celery_slug_as_task_name_and_short_id(
    client: httpx.Client,
) -> None:
    post(client, "start", {"attempt": 1, "started_at": T0}, instance=TASK_ID, step=SLUG)
    post(client, "complete", {"attempt": 1, "completed_at": T1}, instance=TASK_ID, step=SLUG)
    post(client, "start", {"attempt": 1, "started_at": T0}, instance=TASK_ID, step="fetch:3")

    html = page(client, f"/ui/instances/{TASK_ID}")
    assert f'title="{SLUG}">{SHORT}</a>' in html  # the steps table
    lane = f'<tspan class="wide">{SHORT}</tspan><tspan class="narrow">…tasks.charge:5f0c7…'
    assert f"{lane}</tspan><title>{SLUG}</title>" in html  # the timeline's lane label
    assert 'title="fetch:3">fetch:3</a>' in html  # other slugs stay as they are


def test_the_step_page_and_the_failing_view_give_the_full_slug(client: httpx.Client) -> None:
    post(client, "start", {"attempt": 1, "started_at": T0}, instance=TASK_ID, step=SLUG)
    body = {"attempt": 1, "completed_at": T1, "error_code": "CardDeclined"}
    post(client, "fail", body, instance=TASK_ID, step=SLUG)

    step = page(client, f"/ui/instances/{TASK_ID}/steps/{SLUG}")
    assert SLUG in step
    assert f"task id <code>{TASK_ID}</code>" in step
    assert "<code>shop.tasks.charge</code>" in step

    failing = page(client, "/ui/failing")
    assert f'title="{SLUG}">{SHORT}</a>' in failing
