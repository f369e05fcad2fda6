"""The packages of `app/` import one way only: each imports only those its docstring allows
(app/__init__.py has the map), so no import points back up and no two packages import each
other. Read from the source, every import of every module (inside functions too)."""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parent.parent / "app"

# Each package (or top-level module) of `app/`, and the ones it may import. `app` itself holds
# only the version, and every package may read it.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "sql": frozenset(),
    "data": frozenset({"core"}),
    "ops": frozenset({"core", "data"}),
    "access": frozenset({"core", "data"}),
    "live": frozenset({"core", "data", "ops", "access"}),
    "api": frozenset({"core", "data", "ops", "access", "live"}),
    "dashboard": frozenset({"core", "data", "ops", "access", "api"}),
    "gate": frozenset({"core", "data", "access", "api", "dashboard"}),
    "main": frozenset({"core", "data", "sql", "ops", "access", "live", "api", "dashboard", "gate"}),
    "cli": frozenset(
        {"core", "data", "sql", "ops", "access", "live", "api", "dashboard", "gate", "main"}
    ),
}
# Of the API, the dashboard may import only its input checks: a list's label filter is
# checked as the API checks it. Nothing else of the API's internals.
DASHBOARD_FROM_API = frozenset({"app.api.bodies"})
WEB_FRAMEWORKS = ("fastapi", "starlette")


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(APP.rglob("*.py"))}


def imports_of(name: str) -> Iterator[str]:
    """Every module `name` imports, by its full dotted name (`from app.x import y` names
    `app.x.y` when that is a module, else `app.x`)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in MODULES else base


def package_of(name: str) -> str:
    """`core` for `app.core.db`, `live` for `app.live`, `app` for the root."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "app"


def test_every_package_is_placed() -> None:
    assert {package_of(name) for name in MODULES} - {"app"} == set(ALLOWED)


def test_the_allowed_imports_have_no_cycle() -> None:
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, " -> ".join([*path, package])
        if package not in done:
            for below in ALLOWED[package]:
                visit(below, (*path, package))
            done.add(package)

    for package in ALLOWED:
        visit(package, ())


def test_the_root_imports_nothing() -> None:
    assert [i for i in imports_of("app") if i.split(".")[0] == "app"] == []


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"app"}))
def test_each_module_imports_only_the_packages_below_it(name: str) -> None:
    package = package_of(name)
    wrong = []
    for imported in imports_of(name):
        if imported.split(".")[0] != "app" or imported == "app":
            continue
        other = package_of(imported)
        if other == package:
            continue
        narrowed = (package, other) == ("dashboard", "api") and imported not in DASHBOARD_FROM_API
        if other not in ALLOWED[package] or narrowed:
            wrong.append(imported)
    assert wrong == [], f"{name} ({package}) may import only {sorted(ALLOWED[package])}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if package_of(n) in ("data", "sql")))
def test_the_data_layer_never_imports_the_web_framework(name: str) -> None:
    framework = [i for i in imports_of(name) if i.split(".")[0] in WEB_FRAMEWORKS]
    assert framework == []
