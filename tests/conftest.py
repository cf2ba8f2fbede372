"""Shared fixtures: small models and one torch thread (Flower's ones: ``flower/conftest.py``).

Fixtures that a whole file needs are not autouse here: such a file names them once in its
``pytestmark = pytest.mark.usefixtures(...)``.

The suite runs on pytest-xdist workers (pyproject's ``addopts``), one more than the cores: each
worker keeps torch on one thread, and the end-to-end tests spend much of their time waiting (on
Flower's SuperLink and SuperNodes, their 3-second polls, processes starting), which the extra
worker fills.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning, in every process the tests start (simulations,
# Ray workers, SuperNodes, ServerApps inherit it): PyTorch's default of spinning after each
# parallel region burns the cores that the other workers' processes wait for. Measured with
# other work on this 2-core machine: the ten-site simulation test took 189 s with
# OMP_WAIT_POLICY=ACTIVE, 76 s with the default and 61 s with PASSIVE; four processes training
# an MLP on 2 threads each, 450 s against 20 s. The thread counts, and so the numbers, are
# unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from fedfuse.models import build_model, mlp_spec, vgg11_spec


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist does not know it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: the cores, plus one worker for the time the end-to-end tests wait."""
    return (os.cpu_count() or 1) + 1


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture
def tiny_mlp():
    """A 1x4x4-input MLP with two hidden levels, seeded."""
    return build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0)


@pytest.fixture
def tiny_vgg():
    """A narrow VGG11 on 3x32x32 inputs."""
    return build_model(vgg11_spec((3, 32, 32), 10, width_multiplier=1 / 16), seed=0)


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def one_thread():
    """Torch on one intra-op thread for the test, then as before: tiny models only lose from
    threads on a busy (shared) machine, and one thread keeps reductions in one order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
