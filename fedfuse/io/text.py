"""Text from files shown on a terminal: control characters made visible, never obeyed.

Class names in a checkpoint, errors and site names in a ``results.json`` come from files that
someone else may have written. Printed raw, an escape sequence in them could move the cursor,
rewrite earlier lines or retitle the terminal; here each control character is shown as its
Python escape (``\\x1b``) instead.
"""

from __future__ import annotations

import unicodedata


def terminal_safe(text: object) -> str:
    """``str(text)`` with every control or format character (ESC, BEL, CR, bidi overrides ...)
    written as its escape; tabs and printable text are kept."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(
        c if c == "\t" or unicodedata.category(c)[0] not in "CZ" or c == " " else _escaped(c)
        for c in text
    )


def one_line(error: BaseException) -> str:
    """An exception as one line: its message's lines joined, its type named when unclear, and
    control characters (from a file's name or contents) shown escaped, never sent raw."""
    lines = str(error).split("\n")  # only newlines part lines: a CR or ESC is shown escaped
    text = "; ".join(terminal_safe(line.strip()) for line in lines if line.strip())
    if not text or not isinstance(error, ValueError | OSError):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text[:2000]


def _escaped(character: str) -> str:
    return character.encode("unicode_escape").decode("ascii")
