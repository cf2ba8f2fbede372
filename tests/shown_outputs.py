"""What a document shows a command print, checked against what a run of that command printed.

Both sides are compared line by line after :func:`normalise`: the values that differ from run to
run (key fingerprints, node and run ids, run folders, Ray node ids, prediction probabilities)
become placeholders, and runs of spaces and of table rules collapse, so that a table whose
columns widen with a longer id still matches. In the document, a line ``...`` elides any number
of printed lines (the lines between two elisions are printed one after another), and a
``<placeholder>`` such as ``<port>`` stands for any one word. Accuracy tables are compared apart,
with tolerances (:func:`tests.helpers.assert_same_table`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: values that differ between two runs of the same command, and what they become
VARYING = (
    (re.compile(r"SHA256:[A-Za-z0-9+/]{43}"), "SHA256:<fingerprint>"),
    (re.compile(r"\b\d{8}-\d{6}-\S*?-run\d+\b"), "<run-folder>"),
    (re.compile(r"\b\d{10,20}\b"), "<id>"),  # node and run ids
    (re.compile(r"\b[0-9a-f]{12}…"), "<ray-node>…"),
    (re.compile(r"^(\S+\.png,[^,]+),[01]\.\d+$"), r"\1,<probability>"),  # fedfuse predict's rows
)
#: a document's stand-in for one word of the output
PLACEHOLDER = re.compile(r"<[a-z][a-z -]*>")
ELISION = "..."
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*$")


def normalise(line: str, replacements: Iterable[tuple[str, str]] = ()) -> str:
    """``line`` with ``replacements`` (old, new) made, varying values as placeholders, and
    runs of spaces and of the box rule ``─`` collapsed."""
    for old, new in replacements:
        line = line.replace(old, new)
    line = " ".join(re.sub("─+", "─", line).split())
    for pattern, placeholder in VARYING:
        line = pattern.sub(placeholder, line)
    return line


def _same(shown: str, printed: str) -> bool:
    parts = PLACEHOLDER.split(shown)
    pattern = r"\S+".join(re.escape(part) for part in parts)
    return re.fullmatch(pattern, printed) is not None


def assert_shows(printed: str, shown: str, replacements: Iterable[tuple[str, str]] = ()) -> None:
    """Every line of the document's block ``shown`` is in ``printed`` (``replacements`` made
    there first, e.g. a temporary folder for the document's path), in order; the lines between
    two ``...`` one after another. Blank lines are ignored on both sides."""
    replacements = list(replacements)
    got = [line for line in (normalise(raw, replacements) for raw in printed.splitlines()) if line]
    segments: list[list[str]] = [[]]
    for line in (normalise(raw) for raw in shown.splitlines()):
        if line == ELISION:
            segments.append([])
        elif line:
            segments[-1].append(line)
    position = 0
    for segment in filter(None, segments):
        found = next(
            (
                start
                for start in range(position, len(got) - len(segment) + 1)
                if all(_same(s, g) for s, g in zip(segment, got[start:], strict=False))
            ),
            None,
        )
        if found is None:
            printed_part = "\n".join(got[position : position + 60])
            raise AssertionError(
                "the document shows\n" + "\n".join(segment) + "\nbut the run printed (normalised, "
                f"from line {position})\n{printed_part}"
            )
        position = found + len(segment)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block of ``text``, in order: its language ("" for none) and its lines,
    without the fences and the list indentation."""
    blocks, current, indent, lang = [], None, "", ""
    for line in text.splitlines():
        fence = FENCE.match(line)
        if current is None:
            if fence:
                current, indent, lang = [], fence["indent"], fence["lang"]
        elif fence and fence["indent"] == indent and not fence["lang"]:
            blocks.append((lang, "\n".join(current)))
            current = None
        else:
            current.append(line[len(indent) :] if line.startswith(indent) else line)
    assert current is None, "an unclosed code block"
    return blocks


def without_tables(shown: str) -> str:
    """``shown`` with each accuracy table (its header and rows, not its ``(test set ...)``
    line) elided: tables are compared with tolerances, apart."""
    lines, in_table = [], False
    for line in shown.splitlines():
        if line.startswith("model ") and "accuracy" in line:
            in_table = True
            lines.append(ELISION)
        elif in_table and (line.startswith("(test set") or not line.strip()):
            in_table = False
        if not in_table:
            lines.append(line)
    return "\n".join(lines)
