"""Settings helpers: connection strings shown with their secrets hidden."""

import pytest
from psycopg.conninfo import conninfo_to_dict
from pydantic import ValidationError

from app.core.config import Settings, redact

FORMS = {
    "url userinfo": "postgresql://app:s3cret@db.internal:5432/steps",
    "url query": "postgresql://app@db.internal:5432/steps?password=s3cret&sslmode=require",
    "url userinfo and query": "postgresql://app:s3cret@db.internal/steps?password=s3cret",
    "url percent escapes": "postgresql://app:s3%63ret%40x@db.internal/steps",
    "url query percent escapes": "postgresql://app@db.internal/steps?password=s3%63ret",
    "key=value": "host=db.internal port=5432 user=app password=s3cret dbname=steps",
    "key=value quoted": "host=db.internal user=app password='s3cret x' dbname=steps",
    "ssl key passphrase": "postgresql://app@db.internal/steps?sslpassword=s3cret",
}


@pytest.mark.parametrize("conninfo", FORMS.values(), ids=FORMS.keys())
def test_redacting_hides_the_password_in_every_form(conninfo: str) -> None:
    shown = redact(conninfo)
    assert "s3cret" not in shown
    assert "s3%63ret" not in shown
    assert "***" in shown
    params = conninfo_to_dict(shown)
    assert params["host"] == "db.internal"
    assert params.get("user") == "app"
    assert params["dbname"] == "steps"


def test_redacting_keeps_a_connection_string_without_a_password() -> None:
    shown = redact("postgresql://postgres@/postgres?host=/run/pg&port=5432")
    assert "***" not in shown
    assert conninfo_to_dict(shown) == {
        "user": "postgres",
        "dbname": "postgres",
        "host": "/run/pg",
        "port": "5432",
    }


def test_redacting_an_unparseable_string_shows_none_of_it() -> None:
    shown = redact("postgresql://app:s3cret@db.internal/steps?nonsense=1")
    assert "s3cret" not in shown
    assert "db.internal" not in shown


def test_prepared_statements_are_on_by_default_and_none_turns_them_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPRECORD_PREPARE_THRESHOLD", raising=False)
    assert Settings().prepare_threshold == 0  # from a statement's first use
    for value, expected in [("none", None), ("None", None), ("5", 5)]:
        monkeypatch.setenv("STEPRECORD_PREPARE_THRESHOLD", value)
        assert Settings().prepare_threshold == expected
    for refused in ("-1", "off", ""):
        monkeypatch.setenv("STEPRECORD_PREPARE_THRESHOLD", refused)
        with pytest.raises(ValidationError):
            Settings()


def test_a_pool_reserve_as_large_as_the_pool_is_refused_naming_both_settings() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(pool_size=4, pool_reserve=4)
    assert "STEPRECORD_POOL_RESERVE (4) must be smaller than STEPRECORD_POOL_SIZE (4)" in str(
        refused.value
    )
    assert Settings(pool_size=4, pool_reserve=3).pool_reserve == 3
