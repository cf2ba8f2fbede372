"""Small pieces that several test files share: settings, data and model helpers.

Fixtures live in the ``conftest.py`` files; stand-ins for Flower's parts in ``fakes.py``.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from pathlib import Path

import torch
import torchvision

from fedfuse.federation.method_needs import upload_request_for
from fedfuse.federation.upload_request import UploadRequest
from fedfuse.fusion.blocks.alignment import permute_level
from fedfuse.models import LeveledModel
from fedfuse.settings.run import RunSettings

#: sklearn digits (bundled with scikit-learn) and an MLP with one level of 16 units, on the CPU
DIGITS = {"dataset": "digits", "mlp_widths": "16", "device": "cpu"}
#: a quick site: one epoch, conductance from 32 samples in 4 steps, a 40-sample fusion set
QUICK_SITE = {"local_epochs": 1, "score_samples": 32, "score_steps": 4, "fusion_samples": 40}


def digits_settings(**changes) -> RunSettings:
    """The small digits run (:data:`DIGITS`), other keys as given or at their defaults."""
    return RunSettings(**{**DIGITS, **changes})


def quick_site_settings(**changes) -> RunSettings:
    """The small digits run with quick sites (:data:`QUICK_SITE`), ``changes`` on top."""
    return digits_settings(**{**QUICK_SITE, **changes})


def deployment_settings(files, tmp_path: Path, **changes) -> RunSettings:
    """Quick site settings of an in-process deployment: the server's ``files["fusion"]`` and
    ``files["test"]``, outputs under ``tmp_path``, short waits, ``changes`` on top."""
    return quick_site_settings(
        **{
            "fusion_data": str(files["fusion"]),
            "test_data": str(files["test"]),
            "output_dir": str(tmp_path / "outputs"),
            "node_wait_timeout": 1.0,
            "reply_timeout": 60.0,
            **changes,
        }
    )


def run_upload_request(settings: RunSettings) -> UploadRequest:
    """What the ServerApp's train message asks of every site in ``settings``' run (the server's
    derivation from its methods), for tests that call a site directly."""
    return upload_request_for(
        settings.fusion_methods(), settings.fusion_gaussians(), secure=settings.secure_aggregation
    )


def randn(seed: int, *shape: int) -> torch.Tensor:
    """Standard normal values of ``shape``, seeded on their own generator."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_levels_compose(model: LeveledModel, x: torch.Tensor, num_classes: int) -> None:
    """Composing all levels, or splitting the composition in the middle, is the forward pass."""
    composed = x
    for level in model.levels:
        composed = level(composed)
    assert torch.equal(composed, model(x))
    assert model(x).shape == (len(x), num_classes)
    middle = model.num_levels // 2
    assert torch.allclose(
        model.forward_levels(model.forward_levels(x, 0, middle), middle), model(x)
    )


def permuted_copy(model: LeveledModel, seed: int = 0) -> LeveledModel:
    """The same function with every hidden neuron level's neurons shuffled."""
    permuted = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for level in permuted.neuron_levels[:-1]:
        order = torch.randperm(permuted.level_width(level), generator=generator)
        permute_level(permuted, level, order)
    return permuted


def prototype_task(
    samples: int, seed: int, shape: tuple[int, ...], classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` noisy images of ``classes`` fixed prototypes, drawn with ``seed``: a task a
    small model learns in a few dozen steps."""
    prototypes = torch.randn(classes, *shape, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return prototypes[labels] + 1.5 * torch.randn(samples, *shape, generator=generator), labels


def trained_on_prototypes(
    model: torch.nn.Module,
    seed: int,
    shape: tuple[int, ...],
    classes: int,
    *,
    lr: float,
    steps: int,
) -> torch.nn.Module:
    """``model`` trained by Adam on 256 rows of :func:`prototype_task` (its seed ``seed``), in
    batches of 64; returned in eval mode."""
    x, y = prototype_task(256, seed, shape, classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        batch = slice(64 * (step % 4), 64 * (step % 4 + 1))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    return model.eval()


class SmallViT(torchvision.models.VisionTransformer):
    """torchvision's ViT on grey 28x28 images of 4 classes: its own patch conv for one channel."""

    def __init__(self) -> None:
        super().__init__(28, 7, 2, 2, 32, 64, num_classes=4)
        self.conv_proj = torch.nn.Conv2d(1, 32, 7, 7)


def trained_small_vit(seed: int) -> SmallViT:
    """A :class:`SmallViT` trained on :func:`prototype_task` (its seed ``seed``)."""
    torch.manual_seed(seed)
    return trained_on_prototypes(SmallViT(), seed, (1, 28, 28), 4, lr=0.003, steps=48)


def patience(seconds: float) -> float:
    """``seconds`` of wall time for a test's subprocess or wait, scaled to how busy the machine
    is: times the load per core when that is above 1 (other work on the same cores stretches
    every run), or times ``FEDFUSE_TEST_TIME_SCALE`` when set. A limit that holds on a quiet
    machine then holds on a loaded one, and still ends a run that hangs."""
    override = os.environ.get("FEDFUSE_TEST_TIME_SCALE")
    if override:
        return seconds * float(override)
    busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * max(1.0, busy)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the moment of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_test_env(tmp_path) -> tuple[dict[str, str], str]:
    """The environment of a `flwr run` in a test: its own FLWR_HOME and free ports for the
    local SuperLink, this interpreter's scripts first on PATH; and the Control API port (to
    find and stop that SuperLink)."""
    control_port = str(free_port())
    env = {
        **os.environ,
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": control_port,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    return env, control_port


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def accuracy_tables(text: str) -> list[list[list[str]]]:
    """Every accuracy table that a run printed in ``text``, as rows (model, accuracy, loss, what
    each site sends, best marker), without the fusion times, which vary from run to run."""
    lines, tables = text.splitlines(), []
    for start, header in enumerate(lines):
        if not (header.startswith("model ") and "accuracy" in header):
            continue
        rows = []
        for line in lines[start + 2 :]:
            if line.startswith("(test set") or not line.strip():
                break
            cells = [c.strip() for c in line.split("  ") if c.strip()]
            model, accuracy, loss, *rest = cells
            sends = next((c for c in rest if c.startswith("1 upload")), "")
            best = "best single model" if any("best single model" in c for c in rest) else ""
            rows.append([model, accuracy, loss, sends, best])
        tables.append(rows)
    return tables


def assert_same_table(printed: list[list[str]], shown: list[list[str]]) -> None:
    """A table a document shows is the one the run printed: the same rows, losses within 0.02
    and accuracies within 3 points (the same seeds train bit-different sites on CPUs of other
    vector units: between two machines of this kind the ensemble moved 0.62 points and fedavg
    1.75; an AMD EPYC without AVX-512 moved the ensemble 2.37 with its loss within 0.001), and
    what each site sends and the best marker alike."""
    assert [r[0] for r in printed] == [r[0] for r in shown]
    for got, want in zip(printed, shown, strict=True):
        assert abs(float(got[1].rstrip("%")) - float(want[1].rstrip("%"))) <= 3.0, (got, want)
        assert abs(float(got[2]) - float(want[2])) <= 0.02, (got, want)
        assert got[3:] == want[3:], (got, want)


#: the input shape of :class:`SmallNet`
SMALL_NET_SHAPE = (1, 6, 6)


class SmallNet(torch.nn.Module):
    """A user's own small CNN on 1x6x6 inputs, 3 classes (a chain, as Flower's template ``Net``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 4 * 4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(torch.relu(self.conv(x)), 1)
        return self.fc2(torch.relu(self.fc1(x)))
