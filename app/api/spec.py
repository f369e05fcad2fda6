"""Response shapes, for the OpenAPI document (handlers render JSON directly)."""

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, create_model

from ..core import record as record_shape

if TYPE_CHECKING:
    Record = BaseModel
else:
    # A record, from its one definition (app/core/record.py): the fields a summary leaves out may
    # be absent, every other one is always there.
    Record = create_model(
        "Record",
        __config__=ConfigDict(extra="forbid"),
        **{
            field.key: (
                field.python,
                Field(... if field.summary else None, description=field.description),
            )
            for field in record_shape.FIELDS
        },
    )


class RecordPage(BaseModel):
    items: list[Record]
    next_cursor: str | None


class Attempt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempt: int
    status: str
    started_at: str
    completed_at: str | None
    lease_expires_at: str | None
    output: JsonValue = None
    external_output_url: str | None
    error_code: str | None
    error_message: str | None = None
    trace_id: str | None = Field(
        description="The W3C trace id of the request that started the attempt; null when"
        " it had none"
    )
    created_at: str
    updated_at: str
    reported_by: str | None = Field(
        description="Who last wrote the entry: the name of the token whose request did,"
        " `anonymous` without tokens, `sweeper` for a lease the sweeper closed; null when it"
        " was last written before steprecord kept writers"
    )


class AttemptPage(BaseModel):
    items: list[Attempt]
    next_cursor: str | None


class Repair(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step_slug: str
    action: str = Field(description="What was done: `reopen`")
    attempt: int = Field(description="The attempt that was reopened (the step went on at +1)")
    reason: str
    by: str = Field(description="Who: the token's name, `anonymous`, or the CLI's writer name")
    at: str


class RepairPage(BaseModel):
    items: list[Repair]
    next_cursor: str | None


class StepCounts(BaseModel):
    pending: int
    running: int
    completed: int
    failed: int


class InstanceSummary(BaseModel):
    status: str = Field(
        description="running while any step runs, else failed when one failed, else completed"
        " when every step completed, else pending"
    )
    first_started_at: str | None
    last_finished_at: str | None
    duration_ms: float | None = Field(
        description="From the first start to the last finish (to now while running)"
    )
    failing_step: str | None = Field(description="The slug of the most recently failed step")


class Instance(BaseModel):
    id: int
    instance_key: str
    created_at: str
    labels: dict[str, str]
    step_counts: StepCounts
    summary: InstanceSummary


class InstancePage(BaseModel):
    items: list[Instance]
    next_cursor: str | None


class AttemptOutcomes(BaseModel):
    completed: int
    failed: int
    superseded: int
    running: int


class Durations(BaseModel):
    p50: float | None
    p95: float | None
    max: float | None


class StepStatsItem(BaseModel):
    name: str = Field(
        description="The step slug; for a Celery slug (task.name:task-id) the task name alone"
    )
    attempts: AttemptOutcomes
    failure_rate: float | None = Field(description="failed / (completed + failed); null when none")
    duration_ms: Durations = Field(
        description="Of the completed and failed attempts, started_at to completed_at"
    )


class StepStats(BaseModel):
    since: str
    until: str
    items: list[StepStatsItem]


class FieldError(BaseModel):
    field: str
    message: str


class ProblemModel(BaseModel):
    type: str
    title: str
    status: int
    detail: str
    code: str
    errors: list[FieldError] | None = None
    current: Record | None = None
    recorded: bool | None = Field(
        None,
        description="On a stale_attempt: whether this late report of an older attempt is"
        " kept in the step's history (the record never changes for it)",
    )


def _problem(description: str) -> dict[str, Any]:
    return {"model": ProblemModel, "description": description}


def problem_media_types(document: dict[str, Any]) -> dict[str, Any]:
    """Declare error responses as `application/problem+json`, which is what they are."""
    for operation in (op for item in document["paths"].values() for op in item.values()):
        for status, response in operation.get("responses", {}).items():
            content = response.get("content", {})
            if status[0] in "45" and "application/json" in content:
                response["content"] = {"application/problem+json": content["application/json"]}
    return document


BUSY = _problem(
    "This token's (or its key prefix's) share of the database connections is in use (with"
    " Retry-After)"
)


def event_responses() -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": Record, "description": "Applied to, or replayed on, an existing record"},
        201: {"model": Record, "description": "Created the record"},
        400: _problem("Body is not JSON"),
        409: _problem(
            "conflict, stale_attempt, not_started, not_running, ordinal_taken"
            " or instance_key_collision"
        ),
        413: _problem("Output or body too large"),
        422: _problem("Invalid request"),
        429: BUSY,
        503: _problem("Database unavailable"),
    }


def reopen_responses() -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": Record, "description": "Reopened: the record, pending at its next attempt"},
        400: _problem("Body is not JSON"),
        403: _problem("forbidden (not an admin token) or outside_prefix"),
        404: _problem("Instance or step not found"),
        409: _problem("not_finished, stale_attempt (with current) or conflict"),
        422: _problem("Invalid request (a reason is required)"),
        429: BUSY,
        503: _problem("Database unavailable"),
    }


def read_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": model, "description": "OK"},
        404: _problem("Instance or step not found"),
        422: _problem("Invalid request"),
        429: BUSY,
        503: _problem("Database unavailable"),
    }


def patch_responses() -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": Instance, "description": "The instance with its labels merged"},
        400: _problem("Body is not JSON"),
        403: _problem("outside_prefix: outside the token's key prefix"),
        404: _problem("Instance not found"),
        422: _problem("Invalid request, or over a label limit"),
        429: BUSY,
        503: _problem("Database unavailable"),
    }


def delete_responses() -> dict[int | str, dict[str, Any]]:
    return {
        204: {"description": "Deleted, with its records, their history and its repair log"},
        403: _problem(
            "forbidden: the instance was repaired, and only an admin token may erase its repair"
            " log; outside_prefix: outside the token's key prefix"
        ),
        404: _problem("Instance not found"),
        409: _problem("instance_active: a step is running (send force=true to delete anyway)"),
        422: _problem("Invalid request"),
        429: BUSY,
        503: _problem("Database unavailable"),
    }


# One event of the stream, as a Server-Sent Events parser reads its fields. OpenAPI 3.1 has no
# keyword for the items of a stream (3.2's `itemSchema`, which the client generators do not
# read yet), so `schema` describes each event, as schemathesis reads it for 3.0 and 3.1; `data`
# is a string holding the record's JSON (`contentMediaType`, `contentSchema`).
STREAM_EVENT: dict[str, Any] = {
    "title": "RecordEvent",
    "type": "object",
    "required": ["event", "id", "data"],
    "additionalProperties": False,
    "properties": {
        "event": {"type": "string", "const": "record", "description": "The only event sent"},
        "id": {
            "type": "string",
            "pattern": "^[0-9]{1,20}-[0-9]{1,19}$",
            "description": "Send it back as `Last-Event-ID` (or `?last_event_id=`) to resume"
            " after this event",
        },
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": "#/components/schemas/Record"},
            "description": "The record's JSON, as GET .../steps/{step_slug} renders it",
        },
    },
    "description": "One `record` event per record: every record as it stands, then one per"
    " applied write (never for a replay or a refusal). An idle stream gets `: keepalive`"
    " comments, which are no events; the stream ends when the instance is deleted.",
}


def stream_responses() -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "content": {
                "text/event-stream": {
                    # A component (by `hoist_defs`), so that generators name it.
                    "schema": {
                        "$ref": "#/$defs/RecordEvent",
                        "$defs": {"RecordEvent": STREAM_EVENT},
                    }
                }
            },
            "description": "Every record as it stands, then one event per applied write",
        },
        404: _problem("Instance not found"),
        422: _problem("Invalid request (a garbled event id)"),
        429: _problem(
            "Too many open streams for this token, or its connections all in use (with Retry-After)"
        ),
        503: _problem("Database unavailable"),
    }


def request_body(model: type[BaseModel], *, required: bool) -> dict[str, Any]:
    # The body is named among the definitions it uses, so `hoist_defs` makes it a component.
    schema = model.model_json_schema()
    defs = {**schema.pop("$defs", {}), model.__name__: schema}
    return {
        "requestBody": {
            "required": required,
            "content": {
                "application/json": {"schema": {"$ref": f"#/$defs/{model.__name__}", "$defs": defs}}
            },
        }
    }


COMPONENT_REF = "#/components/schemas/"


def hoist_defs(document: dict[str, Any]) -> dict[str, Any]:
    """Move every `$defs` block into the components: an OpenAPI `$ref` resolves only there."""
    components: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            for name, schema in node.pop("$defs", {}).items():
                visit(schema)
                if components.setdefault(name, schema) != schema:
                    raise ValueError(f"two different schemas are named {name}")
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                node["$ref"] = COMPONENT_REF + ref.removeprefix("#/$defs/")
            for value in list(node.values()):
                visit(value)

    visit(document)
    return document


class BatchResult(BaseModel):
    status: int
    record: Record | None = None
    problem: ProblemModel | None = None


class BatchResponse(BaseModel):
    results: list[BatchResult]


def batch_responses() -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": BatchResponse,
            "description": "One result per event, in request order. On a Citus cluster the"
            " events are judged per worker, each worker's events in one transaction there: the"
            " events of a worker that cannot be reached each get a 503 problem `unavailable`"
            " (retry those), and the other workers' events are judged as usual",
        },
        400: _problem("Body is not JSON"),
        413: _problem("Body over 16 MiB"),
        422: _problem("Malformed envelope"),
        429: BUSY,
        503: _problem("Database unavailable"),
    }


def batch_request_body() -> dict[str, Any]:
    kinds = {"type": "string", "enum": ["declare", "start", "complete", "fail", "heartbeat"]}
    event = {
        "type": "object",
        "required": ["instance_key", "step_slug", "kind"],
        "properties": {
            "instance_key": {"type": "string"},
            "step_slug": {"type": "string"},
            "kind": kinds,
        },
        "additionalProperties": True,
        "description": "The fields of the kind's own endpoint, plus instance_key, step_slug, kind.",
    }
    schema = {
        "type": "object",
        "required": ["events"],
        "additionalProperties": False,
        "properties": {
            "events": {"type": "array", "minItems": 1, "maxItems": 1000, "items": event}
        },
    }
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


OPEN_OPERATIONS = ("/healthz", "/readyz")


def with_security(document: dict[str, Any]) -> dict[str, Any]:
    """Declare bearer tokens: every operation needs one but the health checks."""
    components = document.setdefault("components", {})
    components.setdefault("schemas", {})
    components["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "A token from `steprecord token create`.",
        }
    }
    document["security"] = [{"bearer": []}]
    problem = {
        "application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemModel"}}
    }
    for path, item in document["paths"].items():
        for operation in item.values():
            if path in OPEN_OPERATIONS:
                operation["security"] = []
                continue
            responses = operation.setdefault("responses", {})
            responses.setdefault(
                "401", {"description": "Missing or unknown token", "content": problem}
            )
            responses.setdefault(
                "403",
                {
                    "description": "The token's scope is too narrow (`forbidden`), or a write"
                    " names an instance outside the token's key prefix (`outside_prefix`)",
                    "content": problem,
                },
            )
    return document
