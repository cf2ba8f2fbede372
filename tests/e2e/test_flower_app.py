"""End to end: the worked example (Flower's PyTorch template app moved to one-shot fusion) run for
real with `flwr run` on 2 simulated sites, through `fedfuse run-app`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from fedfuse.federation.flower_state import superlink_pids
from tests.helpers import flower_test_env, patience

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-app"


def _run_app(tmp_path: Path, app: Path, run_config: str) -> subprocess.CompletedProcess:
    env, control_port = flower_test_env(tmp_path)
    command = [sys.executable, "-m", "fedfuse.cli.main", "run-app", str(app)]
    command += ["--timeout", str(round(patience(600))), "--run-config", run_config]
    try:
        return subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=patience(660), cwd=tmp_path
        )
    finally:
        leftover = superlink_pids(control_port)
        for pid in leftover:
            os.kill(pid, 9)
        assert not leftover, "fedfuse run-app left its local SuperLink running"


def test_the_example_app_fuses_the_sites_into_its_own_net(tmp_path):
    saved = tmp_path / "final_model.pt"
    completed = _run_app(tmp_path, EXAMPLE, f"train-samples=1500 save-path='{saved}'")
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "one-shot fusion of 2 sites" in output
    # kf-sites ran its statistics rounds through the app's own query handler, and its Net is
    # at least as good as one-shot FedAvg's of the same uploads
    assert "statistics round of level 0 (affine): 2 of 2 sites answered" in output
    scores = dict(
        re.findall(r"^\s+(kf-sites|fedavg)\s+fused in .* accuracy ([\d.]+)", output, re.M)
    )
    assert set(scores) == {"kf-sites", "fedavg"}, output[-4000:]
    assert float(scores["kf-sites"]) >= float(scores["fedavg"]), scores
    sys.path.insert(0, str(EXAMPLE))
    try:
        from flower_app.task import Net, load_centralized_test, test
    finally:
        sys.path.remove(str(EXAMPLE))
    net = Net()
    net.load_state_dict(torch.load(saved, weights_only=True))  # the template's own names
    _, accuracy = test(net, load_centralized_test(2000), "cpu")
    assert accuracy > 0.2, f"the fused Net scores {accuracy:.3f} on 10 classes"


def test_the_example_app_fuses_torchvision_resnet18_with_statistics_rounds(tmp_path):
    """The worked example with torchvision's ResNet-18 (BatchNorm, residual blocks) as ``Net``:
    one line of the app changed, kf-sites fits every conv with its BatchNorm on the sites' data,
    and the fused model loads into a fresh torchvision ResNet."""
    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    task = app / "flower_app" / "task.py"
    task.write_text(task.read_text().replace("Net = TemplateNet", "Net = torchvision_resnet18"))
    saved = tmp_path / "final_model.pt"
    completed = _run_app(tmp_path, app, f"train-samples=300 save-path='{saved}'")
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    # every round reached both sites, down to the last block's conv with its identity
    assert "statistics round of level 0 (conv1): 2 of 2 sites answered" in output, output[-4000:]
    assert "(layer4.1.conv2+identity): 2 of 2 sites answered" in output, output[-4000:]
    scores = dict(
        re.findall(r"^\s+(kf-sites|fedavg)\s+fused in .* accuracy ([\d.]+)", output, re.M)
    )
    assert set(scores) == {"kf-sites", "fedavg"}, output[-4000:]
    # 300 unseeded images per site leave both sites near chance, so which of the two fused
    # models is ahead here is a coin flip (0.112 against 0.156 in one CI run): the quality of
    # kf-sites on resnet18 is guarded by the seeded library test
    # (tests/unit/test_plain_models.py: kf-sites above fedavg on trained sites)
    assert all(0.0 <= float(value) <= 1.0 for value in scores.values()), scores
    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    net.load_state_dict(torch.load(saved, weights_only=True))  # strict: torchvision's names


def test_a_failing_server_app_exits_non_zero_before_any_site_trains(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app)
    server = app / "flower_app" / "server_app.py"
    # the ServerApp does not say that its ClientApp answers statistics rounds
    server.write_text(server.read_text().replace("client_statistics=True", "client_extras=True"))
    completed = _run_app(tmp_path, app, "train-samples=200")
    output = completed.stdout + completed.stderr
    assert completed.returncode == 1, output[-4000:]
    assert "finished:failed" in output and "kf-sites: needs the sites themselves" in output
    assert "answer_statistics" in output
    assert "stored the upload" not in output
