"""`python -m app.sql freeze NNNN_name`: write a revision's frozen upgrade and downgrade.

The migration itself (`migrations/versions/NNNN_name.py`, with its docstring saying why) is
written by hand and reads the two files beside it; see docs/database.md.
"""

import argparse

from . import freeze


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m app.sql", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("freeze", help="freeze app/sql/ into a new revision's files")
    command.add_argument("revision", help="the revision's file name, e.g. 0018_judge_once")
    args = parser.parse_args()
    try:
        paths = freeze(args.revision)
    except ValueError as exc:
        parser.error(str(exc))
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
