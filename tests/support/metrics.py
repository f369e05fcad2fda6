"""The service's Prometheus page and the samples in it."""

import re

import httpx


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` with these labels in a Prometheus text page; fails when
    there is none."""
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', series))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no {name} {labels} in the metrics")


def counter(text: str, name: str, **labels: str) -> float:
    """A counter's value: 0 while it has no sample yet (nothing counted)."""
    try:
        return metric(text, name, **labels)
    except AssertionError:
        return 0.0


def metrics(url: str) -> str:
    """The service's Prometheus page."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return response.text
