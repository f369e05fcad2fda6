"""Text from clients, made safe to show: control characters as visible escapes.

An error message, a repair's reason or an output is data a client sent. Shown as it is, its
terminal escapes (`ESC [ 2 J`, a C1 `CSI`) would drive the terminal that prints it, and its
bidirectional controls (`U+202E` RIGHT-TO-LEFT OVERRIDE, the isolates) would reorder what a
reader sees around them, on a page as in a terminal. `shown` writes each such character as
`\\uXXXX`, its JSON escape, so it is seen and never acted on; in JSON text the result means the
same value. Line breaks and tabs stay as they are (a `\\r` only before a `\\n`).
"""

import re

# C0 controls but tab and line feed (and a carriage return before one), DEL, C1 controls,
# and the bidirectional formatting characters (embeddings, overrides, isolates and marks).
UNSAFE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]|\r(?!\n)"
)


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match[0]):04x}"


def shown(text: str) -> str:
    """`text` with every unsafe character as its visible escape (see the module)."""
    return UNSAFE.sub(_escape, text)
