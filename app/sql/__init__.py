"""The database's functions as source, and the frozen copies the migrations install.

`app/sql/*.sql` is what a database at head runs. A migration never reads it: it installs a
frozen copy beside itself (`migrations/versions/NNNN_name.up.sql`), and its downgrade the
text the revisions before it froze (`.down.sql`). `python -m app.sql freeze NNNN_name`
writes both from the source, so a change of the judge is a change of `app/sql/` and one
command (docs/database.md, "Change a rule of the judge").

A frozen upgrade holds each source file that differs from what the revisions before it
froze, whole, after a line `-- ===== app/sql/NAME.sql =====`, and a line
`-- ===== app/sql/NAME.sql removed =====` for each file that left `app/sql/`; so the text of
every file as of any revision is the last such section at or before it. Functions whose
arguments or result change, or that go away, are dropped first: PostgreSQL changes a
function's arguments only by dropping and creating it. A type (`CREATE TYPE name AS`) has no
CREATE OR REPLACE: when its file changes or goes, it is dropped and its file run again, after
every function whose arguments or result name it is dropped too (and the files of those
functions are frozen again, whole, so they are created again). The downgrade drops what the
upgrade created or changed that way and restores the previous text of each file it froze or
removed.
"""

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from .. import MIGRATIONS

SOURCE = Path(__file__).resolve().parent
VERSIONS = MIGRATIONS / "versions"
COMMAND = "python -m app.sql freeze"

_SECTION = re.compile(r"^-- ===== app/sql/([\w.-]+\.sql) =====\n", re.MULTILINE)
_REMOVED = re.compile(r"^-- ===== app/sql/([\w.-]+\.sql) removed =====$", re.MULTILINE)
_OTHER_SECTION = re.compile(r"^-- ===== ", re.MULTILINE)
# A function a file creates; its name may end in a format() placeholder, the function then
# being a template's (apply_event.sql: the judge, and its copies named after it).
_FUNCTION = re.compile(r"CREATE OR REPLACE FUNCTION (\w+)(?:%\d+\$s)?\s*\(")
_TYPE = re.compile(r"^CREATE TYPE (\w+) AS\b", re.MULTILINE)
_REVISION = re.compile(r"^(\d{4})_\w+$")


def source() -> dict[str, str]:
    """Each file of `app/sql/` by name, in the order a database installs them."""
    return {path.name: path.read_text() for path in sorted(SOURCE.glob("*.sql"))}


def sections(frozen: str) -> dict[str, str]:
    """The source files a frozen upgrade holds, by name, with their text."""
    found: dict[str, str] = {}
    marks = list(_SECTION.finditer(frozen))
    for mark in marks:
        rest = frozen[mark.end() :]
        end = _OTHER_SECTION.search(rest)
        text = rest if end is None else rest[: end.start()]
        found[mark.group(1)] = text.rstrip("\n") + "\n"
    return found


def revision_number(name: str) -> int:
    match = _REVISION.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a revision name such as 0018_judge_once")
    return int(match.group(1))


def frozen_as_of(number: int) -> dict[str, str]:
    """The source as the frozen upgrades of revisions up to `number` (included) left it."""
    files: dict[str, str] = {}
    for path in sorted(VERSIONS.glob("[0-9][0-9][0-9][0-9]_*.up.sql")):
        if revision_number(path.name.removesuffix(".up.sql")) <= number:
            frozen = path.read_text()
            files.update(sections(frozen))
            for removed in _REMOVED.finditer(frozen):
                del files[removed.group(1)]
    return files


@dataclass(frozen=True)
class Function:
    name: str
    arguments: str  # as written, names and defaults included
    header: str  # arguments and result, whitespace collapsed: what CREATE OR REPLACE keeps

    @property
    def signature(self) -> str:
        """The function as DROP FUNCTION names it (argument names allowed, defaults not)."""
        parts = [re.split(r"\s+DEFAULT\s+", part.strip())[0] for part in _split(self.arguments)]
        return f"{self.name}({', '.join(part for part in parts if part)})"


def _split(arguments: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(arguments):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(arguments[start:index])
            start = index + 1
    parts.append(arguments[start:])
    return parts


def functions(files: dict[str, str]) -> dict[str, Function]:
    """The functions the files create, by name, with their arguments and result."""
    found: dict[str, Function] = {}
    for text in files.values():
        for match in _FUNCTION.finditer(text):
            depth, index = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[index], 0)
                index += 1
            arguments = text[match.end() : index - 1]
            result = text[index : text.index("LANGUAGE", index)]
            header = " ".join(f"({arguments}) {result}".split())
            found[match.group(1)] = Function(match.group(1), " ".join(arguments.split()), header)
    return found


def types(files: dict[str, str]) -> set[str]:
    """The types the files create, by name."""
    return {match.group(1) for text in files.values() for match in _TYPE.finditer(text)}


def _naming(function: Function, names: Collection[str]) -> bool:
    """Whether the function's arguments or result name one of the types `names`."""
    return any(re.search(rf"\b{name}\b", function.header) for name in names)


def _users(files: dict[str, str], names: set[str]) -> list[str]:
    """The files that create a function whose arguments or result name one of `names`."""
    return [
        file
        for file, text in files.items()
        if any(_naming(function, names) for function in functions({file: text}).values())
    ]


def _drops(
    gone: dict[str, Function], kept: dict[str, Function], retyped: Collection[str] = ()
) -> list[str]:
    """DROP FUNCTION of each function of `gone` that `kept` lacks or declares otherwise, or
    that names a type of `retyped` (dropped and created again); then DROP TYPE of those."""
    return [
        f"DROP FUNCTION {function.signature};"
        for name, function in gone.items()
        if name not in kept or kept[name].header != function.header or _naming(function, retyped)
    ] + [f"DROP TYPE {name};" for name in sorted(retyped)]


def render(name: str, files: dict[str, str] | None = None) -> tuple[str, str]:
    """The frozen upgrade and downgrade of revision `name` (e.g. `0018_judge_once`): the
    source (`files`, by default `app/sql/` as it is) against what the revisions before froze."""
    number = revision_number(name)
    new = source() if files is None else files
    old = frozen_as_of(number - 1)
    removed = sorted(old.keys() - new.keys())
    changed = [file for file in sorted(new) if new[file] != old.get(file)]
    if not changed and not removed:
        raise ValueError("app/sql/ is as the revisions before froze it: nothing to freeze")
    # The types the upgrade drops (their files change or go), and those the downgrade drops
    # (the files the upgrade runs create them); the functions that name them go with them,
    # and the files of those functions are run again.
    retyped = types({file: old[file] for file in [*changed, *removed] if file in old})
    created = types({file: new[file] for file in changed})
    rerun = sorted({*changed, *_users(new, retyped)})
    restored = sorted({*changed, *removed, *_users(old, created)} & old.keys())
    previous = f"{number - 1:04d}"
    made = [
        f"-- Made by `{COMMAND} {name}`. Never edit it: the source is app/sql/;",
        "-- change it there and freeze a new revision.",
    ]
    up = [
        f"-- Revision {name}, upgrade: the files of app/sql/ that changed since revision",
        f"-- {previous}, whole.",
        *made,
    ]
    gone = {file: old[file] for file in rerun + removed if file in old}
    drops = _drops(functions(gone), functions(new), retyped)
    if drops:
        what = "Functions whose arguments or result change, or that go away"
        if retyped:
            what += ", and the types made again with the functions that name them"
        up += ["", f"-- {what}:", *drops]
    for file in rerun:
        up += ["", f"-- ===== app/sql/{file} =====", new[file].rstrip("\n")]
    for file in removed:
        up += ["", f"-- ===== app/sql/{file} removed ====="]
    down = [
        f"-- Revision {name}, downgrade: the same files as of revision {previous}.",
        *made,
    ]
    made_here = {file: new[file] for file in sorted({*rerun, *_users(new, created)})}
    drops = _drops(functions(made_here), functions(old), created)
    if drops:
        what = "Functions this revision created or declared otherwise"
        if created:
            what += ", and the types it created, with the functions that name them"
        down += ["", f"-- {what}:", *drops]
    for file in restored:
        down += ["", f"-- ===== app/sql/{file} as of revision {previous} =====", old[file]]
    return "\n".join(up) + "\n", "\n".join(down).rstrip("\n") + "\n"


def freeze(name: str) -> tuple[Path, Path]:
    """Write revision `name`'s frozen upgrade and downgrade beside its migration."""
    up, down = render(name)
    paths = VERSIONS / f"{name}.up.sql", VERSIONS / f"{name}.down.sql"
    paths[0].write_text(up)
    paths[1].write_text(down)
    return paths
