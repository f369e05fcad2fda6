"""Run a migration's SQL text (a frozen `.sql` file, or a script of its own) one statement at
a time.

PostgreSQL runs a text of several statements sent at once, but on Citus the coordinator
forwards some of them to the workers as the whole text it received, which a worker refuses
("cannot insert multiple commands into a prepared statement"): a migration of a distributed
database fails. Sent one by one, each statement reaches the workers alone; on one node the
result is the same, in the same transaction.
"""

from alembic import op

_DOLLAR_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def statements(script: str) -> list[str]:
    """The statements of `script`, each without its `;`; pieces holding only comments and
    blanks are left out. A `;` inside a string, a quoted name, a comment or a dollar-quoted
    body (a function's) ends nothing."""
    found: list[str] = []
    start, index, code = 0, 0, False  # code: the piece holds more than comments and blanks
    while index < len(script):
        char, pair = script[index], script[index : index + 2]
        if pair == "--":
            end = script.find("\n", index)
            index = len(script) if end < 0 else end + 1
            continue
        if pair == "/*":
            index = _block_comment_end(script, index)
            continue
        code = code or not char.isspace()
        if char in "'\"":
            index = _quoted_end(script, index, char)
        elif char == "$" and (tag := _dollar_tag(script, index)) is not None:
            end = script.find(tag, index + len(tag))
            index = len(script) if end < 0 else end + len(tag)
        elif char == ";":
            if code:
                found.append(script[start:index].strip())
            start, index, code = index + 1, index + 1, False
        else:
            index += 1
    if code:
        found.append(script[start:].strip())
    return found


def run(script: str) -> None:
    """Execute `script` in the migration's transaction, statement by statement."""
    for statement in statements(script):
        op.execute(statement)


def _block_comment_end(script: str, index: int) -> int:
    """The index just past the (possibly nested) block comment opening at `index`."""
    depth = 0
    while index < len(script):
        pair = script[index : index + 2]
        if pair in ("/*", "*/"):
            depth += 1 if pair == "/*" else -1
            index += 2
            if depth == 0:
                return index
        else:
            index += 1
    return index


def _quoted_end(script: str, index: int, quote: str) -> int:
    """The index just past the string or name quoted by `quote` opening at `index` (a doubled
    quote inside it is the quote itself)."""
    index += 1
    while index < len(script):
        if script[index] == quote:
            if script[index + 1 : index + 2] != quote:
                return index + 1
            index += 1
        index += 1
    return index


def _dollar_tag(script: str, index: int) -> str | None:
    """The dollar quote (`$$`, `$fn$`) opening at `index`, or None where `$` opens none (a
    parameter such as `$1`, or a `$` inside a name)."""
    if index > 0 and script[index - 1] in _DOLLAR_TAG_CHARS:
        return None
    end = index + 1
    while end < len(script) and script[end] in _DOLLAR_TAG_CHARS:
        end += 1
    tag = script[index + 1 : end]
    if end == len(script) or script[end] != "$" or tag[:1].isdigit():
        return None
    return script[index : end + 1]
