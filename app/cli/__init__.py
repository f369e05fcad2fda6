"""The `steprecord` command, one module per subcommand: `serve`, `migrate` (and the database
every one-off command works on), `grant`, `prune`, `token`, `repair` and `openapi`; `command`
holds the argument parser and runs the subcommand asked for (`main`, the console script).
It sits above everything: it may import any package of `app`, and none imports it."""

from .command import main

__all__ = ["main"]
