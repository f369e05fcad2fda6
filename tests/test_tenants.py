"""Tokens with a key prefix: for such a token, the instances outside the prefix do not exist.

One server with two workers and a database of this module's own: every answer is asked of
both workers (each keeps its own view of the tokens).
"""

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from app.core.tables import STATUSES
from app.data import reads
from tests.support.databases import migrated_database
from tests.support.plans import plan
from tests.support.servers import logged_server, steprecord
from tests.support.tokens import access_loaded
from tests.support.waits import eventually

WORKERS = 2
TRIES = 4  # requests per check: both workers answer some of them
REFRESH = {"STEPRECORD_TOKEN_REFRESH_SECONDS": "0.5"}
BASE_TOKENS = 3  # admin, acme-write, acme-read
# A running instance's summary counts its duration to the moment it is read.
RUNNING_FOR = re.compile(rb'"duration_ms":[0-9.]+')


class Tenants:
    def __init__(self, url: str, database_url: str, log: Path) -> None:
        self.url, self.database_url, self.log = url, database_url, log
        self.admin = self.create("admin", "write")
        self.acme = self.create("acme-writer", "write", "acme-")
        self.acme_read = self.create("acme-reader", "read", "acme-")
        self.loaded(BASE_TOKENS)

    def create(self, name: str, scope: str, prefix: str | None = None) -> dict[str, str]:
        args = ["token", "create", name, "--scope", scope]
        done = steprecord(self.database_url, *args, *(["--prefix", prefix] if prefix else []))
        assert done.returncode == 0, done.stderr
        return {"Authorization": f"Bearer {done.stdout.strip()}"}

    def signed_in(self, token: dict[str, str]) -> dict[str, str]:
        """The Cookie header of a dashboard session of `token`, signed in with the form."""
        answer = httpx.post(
            self.url + "/ui/login",
            data={"token": token["Authorization"].removeprefix("Bearer ")},
            headers={"Origin": self.url},
        )
        assert answer.status_code == 303, answer.text
        return {"Cookie": answer.headers["set-cookie"].split(";")[0]}

    def loaded(self, tokens: int) -> None:
        eventually(lambda: access_loaded(self.log, WORKERS, tokens))

    def send(self, method: str, path: str, token: dict[str, str], **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=token, timeout=30, **kw)

    def every(self, method: str, path: str, token: dict[str, str], **kw: Any) -> httpx.Response:
        """Ask both workers; every answer must be the same (a page's status, as it shows the
        time it was rendered); the last one is returned."""
        answers = [self.send(method, path, token, **kw) for _ in range(TRIES)]
        page = path.startswith("/ui")
        shown = {(a.status_code, page or RUNNING_FOR.sub(b"", a.content)) for a in answers}
        assert len(shown) == 1, answers
        return answers[-1]


@pytest.fixture(scope="module")
def tenants(server_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    with migrated_database(server_dsn, "steprecord_tenants_") as database_url:
        log = tmp_path_factory.mktemp("tenants") / "stdout.jsonl"
        with logged_server(database_url, log, "--workers", str(WORKERS), env=REFRESH) as url:
            yield Tenants(url, database_url, log)


@pytest.fixture
def world(tenants: Tenants) -> Iterator[Tenants]:
    """Instances of two tenants, written with the unprefixed token; emptied afterwards."""
    for key in ("acme-1", "acme-2", "globex-1"):
        for step in ("a", "b"):
            start = tenants.send("POST", f"/v1/instances/{key}/steps/{step}/start", tenants.admin)
            assert start.status_code == 201, start.text
    yield tenants
    with psycopg.connect(tenants.database_url, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE process_instance, workflow_step_record, workflow_step_attempt,"
            " workflow_step_repair"
        )


READS = [
    "/v1/instances/{key}",
    "/v1/instances/{key}/steps",
    "/v1/instances/{key}/steps/a",
    "/v1/instances/{key}/steps/a/attempts",
    "/v1/instances/{key}/stream",
]


def test_reads_outside_the_prefix_answer_as_for_a_missing_instance(world: Tenants) -> None:
    for path in READS:
        outside = world.every("GET", path.format(key="globex-1"), world.acme_read)
        missing = world.every("GET", path.format(key="globex-404"), world.acme_read)
        assert outside.status_code == missing.status_code == 404, outside.text
        assert outside.headers["content-type"] == missing.headers["content-type"]
        assert outside.json()["code"] == "instance_not_found"
        assert outside.text.replace("globex-1", "K") == missing.text.replace("globex-404", "K")
    for path in READS[:-1]:  # inside the prefix, and for the unprefixed token, it exists
        assert world.every("GET", path.format(key="acme-1"), world.acme_read).status_code == 200
        assert world.every("GET", path.format(key="globex-1"), world.admin).status_code == 200
    with httpx.stream(
        "GET", world.url + "/v1/instances/acme-1/stream", headers=world.acme_read, timeout=30
    ) as stream:
        assert stream.status_code == 200


def test_writes_outside_the_prefix_are_refused_and_write_nothing(world: Tenants) -> None:
    writes: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/instances/{key}/steps/a/start", {}),
        ("POST", "/v1/instances/{key}/steps/c/declare", {}),
        ("POST", "/v1/instances/{key}/steps/a/complete", {"json": {"output": 1}}),
        ("POST", "/v1/instances/{key}/steps/a/fail", {"json": {"error_code": "E"}}),
        ("POST", "/v1/instances/{key}/steps/a/heartbeat", {"json": {"attempt": 1}}),
        ("DELETE", "/v1/instances/{key}?force=true", {}),
    ]
    before = world.every("GET", "/v1/instances/globex-1/steps", world.admin).json()
    for method, path, kw in writes:
        for key in ("globex-1", "globex-new"):  # an existing instance, and a new one
            refused = world.every(method, path.format(key=key), world.acme, **kw)
            assert refused.status_code == 403, refused.text
            body = refused.json()
            assert body["code"] == "outside_prefix"
            assert body["title"] == "Instance outside the token's key prefix"
            assert body["prefix"] == "acme-"
            assert f"instance {key!r}" in body["detail"]
            assert "starts with 'acme-'" in body["detail"]
    assert world.every("GET", "/v1/instances/globex-1/steps", world.admin).json() == before
    assert world.every("GET", "/v1/instances/globex-new", world.admin).status_code == 404
    # The same token writes inside its prefix, a new instance included.
    assert world.send("POST", "/v1/instances/acme-3/steps/a/start", world.acme).status_code == 201
    assert world.send("DELETE", "/v1/instances/acme-3?force=true", world.acme).status_code == 204
    # A read token with a prefix is still a read token.
    refused = world.send("POST", "/v1/instances/acme-1/steps/z/start", world.acme_read)
    assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")


def test_a_batch_reaching_outside_the_prefix_is_refused_whole(world: Tenants) -> None:
    inside = {"kind": "start", "instance_key": "acme-9", "step_slug": "a"}
    outside = {"kind": "start", "instance_key": "globex-9", "step_slug": "a"}
    invalid = {"kind": "start", "instance_key": "globex-1", "step_slug": "bad slug"}
    for events in ([inside, outside], [outside, inside, outside], [inside, invalid]):
        refused = world.every("POST", "/v1/events", world.acme, json={"events": events})
        assert refused.status_code == 403, refused.text
        assert refused.json()["code"] == "outside_prefix"
        assert "nothing was written" in refused.json()["detail"]
    assert (
        "and 1 more outside it"
        in world.send(
            "POST", "/v1/events", world.acme, json={"events": [outside, inside, outside]}
        ).json()["detail"]
    )
    for key in ("acme-9", "globex-9"):
        assert world.every("GET", f"/v1/instances/{key}", world.admin).status_code == 404
    done = world.send("POST", "/v1/events", world.acme, json={"events": [inside]})
    assert [r["status"] for r in done.json()["results"]] == [201]


def keys_of(world: Tenants, path: str, token: dict[str, str], **params: Any) -> list[str]:
    """Every instance key a list shows, page after page."""
    keys, cursor = [], None
    while True:
        query = {**params, "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = world.every("GET", path, token, params=query).json()
        keys += [item["instance_key"] for item in page["items"]]
        if page["next_cursor"] is None:
            return keys
        cursor = page["next_cursor"]


def test_labels_never_widen_what_a_prefixed_token_sees(world: Tenants) -> None:
    for key in ("acme-1", "globex-1"):
        labelled = world.send(
            "PATCH", f"/v1/instances/{key}", world.admin, json={"labels": {"env": "prod"}}
        )
        assert labelled.status_code == 200, labelled.text
    prod = {"label": "env=prod"}
    assert keys_of(world, "/v1/instances", world.acme_read, **prod) == ["acme-1"]
    assert keys_of(world, "/v1/steps", world.acme_read, **prod) == ["acme-1"] * 2
    assert len(keys_of(world, "/v1/steps", world.admin, **prod)) == 4
    stats = world.send("GET", "/v1/stats/steps", world.acme_read, params=prod).json()
    assert [i["attempts"]["running"] for i in stats["items"]] == [1, 1]  # acme-1's a and b
    outside = world.send(
        "PATCH", "/v1/instances/globex-1", world.acme, json={"labels": {"env": "acme"}}
    )
    assert outside.status_code == 403, outside.text
    assert outside.json()["code"] == "outside_prefix"
    assert world.every("GET", "/v1/instances/globex-1", world.admin).json()["labels"] == {
        "env": "prod"
    }
    read_only = world.send("PATCH", "/v1/instances/acme-1", world.acme_read, json={"labels": {}})
    assert read_only.status_code == 403


def test_the_lists_show_only_the_prefix_and_cursors_do_not_cross(world: Tenants) -> None:
    for key in ("acmeX-1", "acme", "globex-2"):  # keys that start like the prefix, but not with it
        assert world.send("POST", f"/v1/instances/{key}/steps/a/start", world.admin).is_success
    assert keys_of(world, "/v1/instances", world.acme_read) == ["acme-2", "acme-1"]
    assert sorted(keys_of(world, "/v1/steps", world.acme_read)) == ["acme-1"] * 2 + ["acme-2"] * 2
    assert len(keys_of(world, "/v1/instances", world.admin)) == 6
    assert len(keys_of(world, "/v1/steps", world.admin, status="running")) == 9
    item = world.every("GET", "/v1/instances", world.acme_read).json()["items"][0]
    assert item["step_counts"] == {"pending": 0, "running": 2, "completed": 0, "failed": 0}
    # The unprefixed token's cursor, past globex-2 and acmeX-1, still shows acme's only.
    page = world.every("GET", "/v1/instances", world.admin, params={"limit": 1}).json()
    assert page["items"][0]["instance_key"] == "globex-2"
    cursor = {"cursor": page["next_cursor"]}
    shown = world.every("GET", "/v1/instances", world.acme_read, params=cursor).json()["items"]
    assert [i["instance_key"] for i in shown] == ["acme-2", "acme-1"]
    page = world.every("GET", "/v1/steps", world.admin, params={"limit": 1}).json()
    cursor = {"cursor": page["next_cursor"]}
    shown = world.every("GET", "/v1/steps", world.acme_read, params=cursor).json()["items"]
    assert {i["instance_key"] for i in shown} == {"acme-1", "acme-2"}


def test_the_dashboard_shows_only_the_prefix(world: Tenants) -> None:
    cookie = world.signed_in(world.acme_read)
    listing = world.every("GET", "/ui", cookie).text
    assert "acme-1" in listing
    assert "acme-2" in listing
    assert "globex-1" not in listing
    for wanted, shown in [("globex", []), ("acme-2", ["acme-2"]), ("ac", ["acme-1", "acme-2"])]:
        page = world.every("GET", "/ui", cookie, params={"prefix": wanted}).text
        for key in ("acme-1", "acme-2", "globex-1"):
            assert (f">{key}</a>" in page) == (key in shown), (wanted, key)
    for key in ("acme-1", "globex-1"):
        failed = {"attempt": 1, "error_code": "Declined"}
        assert world.send("POST", f"/v1/instances/{key}/steps/a/fail", world.admin, json=failed)
    failing = world.every("GET", "/ui/failing", cookie).text
    assert "acme-1" in failing
    assert "globex-1" not in failing
    for path in ("/ui/instances/globex-1", "/ui/instances/globex-1/steps/a"):
        assert world.every("GET", path, cookie).status_code == 404
        assert world.every("GET", path.replace("globex", "acme"), cookie).status_code == 200


def test_the_metrics_which_count_every_instance_need_a_token_without_a_prefix(
    world: Tenants,
) -> None:
    refused = world.every("GET", "/metrics", world.acme_read)
    assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")
    assert "use a token without a prefix" in refused.json()["detail"]
    assert world.send("GET", "/metrics", world.admin).status_code == 200


def test_prefixed_tokens_reach_every_worker_when_created_and_revoked(world: Tenants) -> None:
    initech = world.create("initech", "read", "initech-")
    world.loaded(BASE_TOKENS + 1)
    assert world.every("GET", "/v1/instances", initech).json()["items"] == []
    assert world.every("GET", "/v1/instances/acme-1", initech).status_code == 404
    listing = steprecord(world.database_url, "token", "list").stdout
    lines = {line.split("\t")[0]: line.split("\t") for line in listing.splitlines()}
    assert lines["initech"][1:3] == ["read", "prefix initech-"]
    assert lines["admin"][1:3] == ["write", "all instances"]
    assert steprecord(world.database_url, "token", "revoke", "initech").returncode == 0
    world.loaded(BASE_TOKENS)
    assert world.every("GET", "/v1/instances", initech).status_code == 401


def test_a_prefix_outside_the_key_alphabet_is_refused(tenants: Tenants) -> None:
    for prefix in ("-acme", "acme/", "a" * 101, "ac me", ""):
        done = steprecord(
            tenants.database_url, "token", "create", "bad", "--scope", "read", f"--prefix={prefix}"
        )
        assert done.returncode == 2, prefix
        assert done.stdout == ""
        assert "a prefix is 1-100 characters of [A-Za-z0-9._:-]" in done.stderr
    with (
        psycopg.connect(tenants.database_url) as conn,
        pytest.raises(psycopg.errors.CheckViolation) as refused,
    ):
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256, key_prefix)"
            " VALUES ('bad', 'read', sha256('x'), 'acme/')"
        )
    assert refused.value.diag.constraint_name == "ck_api_token_key_prefix_format"


def test_an_undelimited_prefix_is_refused_suggesting_a_delimited_one(tenants: Tenants) -> None:
    done = steprecord(
        tenants.database_url, "token", "create", "bad", "--scope", "read", "--prefix", "acme"
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert "must end with ':', '-' or '.'" in done.stderr
    assert "'acmeevil-1'" in done.stderr
    assert "use e.g. 'acme:'" in done.stderr
    with (
        psycopg.connect(tenants.database_url) as conn,
        pytest.raises(psycopg.errors.CheckViolation) as refused,
    ):
        conn.execute(
            "INSERT INTO api_token (name, scope, token_sha256, key_prefix)"
            " VALUES ('bad', 'read', sha256('x'), 'acme')"
        )
    assert refused.value.diag.constraint_name == "ck_api_token_key_prefix_separated"


def test_a_delimited_prefix_never_reaches_keys_that_merely_start_the_same(
    world: Tenants,
) -> None:
    for key in ("acmeevil-1", "acme:1"):
        start = world.send("POST", f"/v1/instances/{key}/steps/a/start", world.admin)
        assert start.status_code == 201, start.text
    colon = world.create("acme-colon", "write", "acme:")
    world.loaded(BASE_TOKENS + 1)
    try:
        listed = world.every("GET", "/v1/instances", colon).json()["items"]
        assert [item["instance_key"] for item in listed] == ["acme:1"]
        for key in ("acmeevil-1", "acme-1"):
            read = world.every("GET", f"/v1/instances/{key}", colon)
            assert read.status_code == 404, read.text
            write = world.every("POST", f"/v1/instances/{key}/steps/x/start", colon)
            assert write.status_code == 403, write.text
        assert world.every("GET", "/v1/instances/acme:1", colon).status_code == 200
    finally:
        assert steprecord(world.database_url, "token", "revoke", "acme-colon").returncode == 0
        world.loaded(BASE_TOKENS)


def test_a_dashboard_session_holds_on_every_worker_until_its_token_is_revoked(
    world: Tenants,
) -> None:
    token = world.create("dashboard-session", "read", "acme-")
    world.loaded(BASE_TOKENS + 1)
    cookie = world.signed_in(token)
    assert world.every("GET", "/ui", cookie).status_code == 200  # one secret for the workers
    assert steprecord(world.database_url, "token", "revoke", "dashboard-session").returncode == 0
    world.loaded(BASE_TOKENS)
    refused = world.every("GET", "/ui", cookie)
    assert refused.status_code == 401
    assert "The token this browser kept is unknown or revoked" in refused.text


# --- the lists' plans ----------------------------------------------------------------------


@pytest.fixture
def two_tenants(db: psycopg.Connection[tuple[object, ...]]) -> Any:
    """10^4 instances of 5 steps, 1% of them acme's (rolled back after the test)."""
    db.execute("""
        INSERT INTO process_instance (id, instance_key, created_at)
        SELECT steprecord_instance_id(k), k, timestamptz '2026-01-01' + i * interval '1 s'
        FROM generate_series(1, 10000) i,
             LATERAL (SELECT CASE WHEN i % 100 = 0 THEN 'acme-' ELSE 'globex-' END || i AS k) x
    """)
    db.execute("""
        INSERT INTO workflow_step_record (instance_id, step_slug, ordinal, status, attempt_count,
                                          started_at, completed_at, error_code,
                                          lease_expires_at, updated_at)
        SELECT p.id, 'step-' || s, s, x.status, 1,
               CASE WHEN x.status <> 'pending' THEN timestamptz '2026-01-01' END,
               CASE WHEN x.status IN ('completed', 'failed') THEN timestamptz '2026-01-02' END,
               CASE WHEN x.status = 'failed' THEN 'E' END,
               CASE WHEN x.status = 'running' THEN timestamptz '2026-01-03' END,
               timestamptz '2026-01-01' + (n * 5 + s) * interval '1 s'
        FROM process_instance p, generate_series(0, 4) s,
             LATERAL (SELECT split_part(p.instance_key, '-', 2)::int AS n) k,
             LATERAL (SELECT (ARRAY['pending', 'running', 'completed', 'failed'])[1 + s % 4]
                      AS status) x
    """)
    db.execute("ANALYZE process_instance")
    db.execute("ANALYZE workflow_step_record")
    return db


# In a database whose collation is C, the unique index on the key is byte-ordered too and the
# planner may read the prefix's range from it instead.
PREFIX_INDEXES = ("ix_process_instance_instance_key_prefix", "uq_process_instance_instance_key")


def range_scanned(text: str) -> bool:
    """The plan reads the prefix's keys as a range of an index (an Index Cond: byte-wise
    operators on the prefix index, or plain ones on the unique index in a C-collated
    database), and scans no table whole.

    On Citus the coordinator's plan shows a shard's plan under each Custom Scan, with the
    shard's index (the index's name and the shard's id): the instances' shard is read as the
    same range, and no instances' shard is scanned whole. Each records' shard is then joined
    to the instances the coordinator collected, an intermediate result the planner guesses
    at a thousand rows, which against a shard this small it reads whole: that scan is the
    planner's costing of one small shard, not the prefix's range, so it is not held here."""
    scans = [
        line
        for line in text.splitlines()
        if "Index Cond" in line
        and ("instance_key ~>=~ 'acme-'" in line or "instance_key >= 'acme-'" in line)
    ]
    whole = "Seq Scan on process_instance" if "Custom Scan (Citus" in text else "Seq Scan"
    return bool(scans) and any(i in text for i in PREFIX_INDEXES) and whole not in text


def test_each_prefixed_list_reads_the_prefix_as_an_index_range(two_tenants: Any) -> None:
    prefix = reads.prefix_params("acme-")
    instances = {"before_created_at": "infinity", "before_id": 0, "limit": 101, **prefix}
    text = plan(two_tenants, reads.list_instances_query(prefix=True, has=None), instances)
    assert range_scanned(text), text
    recent = {"before": "infinity", "before_id": 0, "updated_after": None, "limit": 101}
    for statuses, updated_after, lease_expired in [
        (STATUSES, False, False),
        (("failed",), False, False),
        (("running", "completed"), True, False),
        (("running",), False, True),
    ]:
        query = reads.list_recent_query(
            statuses, updated_after=updated_after, lease_expired=lease_expired, prefix=True
        )
        params = {**recent, **prefix, "updated_after": "2026-01-01"}
        text = plan(two_tenants, query, params)
        assert range_scanned(text), text
