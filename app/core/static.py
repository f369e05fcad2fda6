"""Static files served by the service itself, so its pages work with no network beyond it.

Each set of files is mounted under `/static/{name}/`; the API docs use it for Swagger UI and
ReDoc, and any later page with its own scripts or styles mounts its folder the same way.
"""

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

PREFIX = "/static"
# Swagger UI, ReDoc and a favicon, each with its licence header, from the `fastapi-offline`
# distribution (the same files FastAPI would otherwise load from a CDN).
DOCS_ASSETS = Path(str(files("fastapi_offline") / "static"))


def url(name: str, file: str) -> str:
    """Where `file` of the set `name` is served."""
    return f"{PREFIX}/{name}/{file}"


def mount(app: FastAPI, name: str, directory: Path) -> None:
    """Serve the files of `directory` under `/static/{name}/`."""
    app.mount(f"{PREFIX}/{name}", StaticFiles(directory=directory), name=f"static-{name}")
