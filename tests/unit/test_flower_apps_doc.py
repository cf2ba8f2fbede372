"""docs/flower-apps.md's by-hand commands work as written: ``flwr run`` of the example is preceded
by the setting that stops Flower installing fedfuse from the registry, and the doc puts the saved
model where the example's ``save-path`` writes it (relative to the working directory)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "flower-apps.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_the_by_hand_flwr_run_disables_runtime_dependency_installation():
    blocks = [b for b in _bash_blocks(GUIDE) if "flwr run examples/flower-app" in b]
    assert blocks, "the guide has no by-hand flwr run of the example"
    for block in blocks:
        before = block.split("flwr run examples/flower-app")[0]
        assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in before, block


def test_the_guide_puts_the_saved_model_where_the_example_writes_it():
    config = tomllib.loads((ROOT / "examples" / "flower-app" / "pyproject.toml").read_text())
    save_path = config["tool"]["flwr"]["app"]["config"]["save-path"]
    assert not Path(save_path).is_absolute()  # written relative to the working directory
    flat = " ".join(GUIDE.split())
    assert f"examples/flower-app/{save_path}" not in flat
    assert f"to `{save_path}` in the directory you ran the command from" in flat
