"""The wheel installs the service as one top-level package, `steprecord` (the folder `app/`),
with `steprecord.migrations` (the folder `migrations/`) inside it: nothing generic at the top
of site-packages. pyproject.toml lists the packages; none of the clone's is left out."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_wheel_holds_one_top_level_package() -> None:
    assert {name.partition(".")[0] for name in SETUPTOOLS["packages"]} == {"steprecord"}
    assert SETUPTOOLS["package-dir"] == {
        "steprecord": "app",
        "steprecord.migrations": "migrations",
    }


def test_every_package_of_the_clone_is_in_the_wheel() -> None:
    found = {
        ".".join([name, *init.parent.relative_to(ROOT / folder).parts])
        for name, folder in SETUPTOOLS["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == set(SETUPTOOLS["packages"])
