"""steprecord: one durable, database-guarded record per step of a process instance."""

# The one place the version is written: the wheel's metadata, `steprecord --version` and the
# OpenAPI document take it from here.
__version__ = "0.1.0"
