"""Alembic environment: the service's own (`migration_environment` of the service's `main`
module) runs the migrations.

Alembic loads this file by path, not as a module of a package, and the service's package is
`app` in a clone and `steprecord` installed: this file names neither. The service's
`alembic_config()` hands the environment over in `config.attributes["environment"]`
(`steprecord migrate`, and alembic's `command` API run with that config); alembic's command line
in a clone finds it through the `environment` option of `[tool.alembic]` in pyproject.toml.
"""

import pkgutil

from alembic import context

environment = context.config.attributes.get("environment")
if environment is None:
    named = context.config.get_alembic_option("environment")
    if named is None:
        raise SystemExit("run `steprecord migrate`, or alembic with the service's alembic_config()")
    environment = pkgutil.resolve_name(named)
environment(context)
