"""The worked example keeps its promise: a template app moves to one-shot fusion with kf-sites by
changing at most 10 lines of its ServerApp and 11 of its ClientApp (2 for the extras' call, 9 for
the statistics rounds' query handler), with public fedfuse names only."""

import ast
import difflib
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "examples" / "flower-app" / "flower_app"


def changed_lines(before: Path, after: Path) -> int:
    """Lines changed from ``before`` to ``after``: a replaced block counts its longer side."""
    a, b = before.read_text().splitlines(), after.read_text().splitlines()
    total = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag != "equal":
            total += max(i2 - i1, j2 - j1)
    return total


@pytest.mark.parametrize(("side", "most"), [("server_app", 10), ("client_app", 11)])
def test_the_move_changes_few_lines(side, most):
    changed = changed_lines(APP / f"template_{side}.py", APP / f"{side}.py")
    assert 0 < changed <= most


@pytest.mark.parametrize("side", ["server_app", "client_app"])
def test_the_app_uses_public_fedfuse_names_only(side):
    tree = ast.parse((APP / f"{side}.py").read_text())
    imported = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedfuse")
        for alias in node.names
    ]
    assert imported
    for module, name in imported:
        assert not name.startswith("_") and "._" not in f"{module}.{name}"
        package = __import__(module, fromlist=[name])
        assert name in package.__all__, f"{module}.{name} is not exported"


@pytest.mark.parametrize("side", ["server_app", "client_app"])
def test_the_guide_shows_the_diff_as_it_is(side):
    guide = (APP.parents[2] / "docs" / "flower-apps.md").read_text()
    before = (APP / f"template_{side}.py").read_text().splitlines()
    after = (APP / f"{side}.py").read_text().splitlines()
    changes = [
        line
        for line in difflib.unified_diff(before, after, lineterm="")
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changes
    for line in changes:
        assert f"\n{line}\n" in guide, f"docs/flower-apps.md lacks the diff line {line!r}"
