"""HTTP handlers: parse, call a data module, shape the answer; one module per group of routes.

`ROUTES` holds them all, in the order the OpenAPI document lists them.
"""

from starlette.routing import BaseRoute

from . import events, health, instances, reads, repairs, stats

ROUTES: list[BaseRoute] = [
    *events.router.routes,
    *reads.router.routes,
    *repairs.router.routes,
    *stats.router.routes,
    *instances.router.routes,
    *health.router.routes,
]
