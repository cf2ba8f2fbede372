"""``fedfuse speed`` on tiny ResNets and ViTs: accepting methods timed, refusals and failures
reported with their reason, the others going on."""

from __future__ import annotations

import math

import pytest
from torch import nn
from torchvision.models.resnet import BasicBlock

from fedfuse.cli.main import main
from fedfuse.experiments import speed, speed_options, speed_plain
from fedfuse.fusion.registry import FUSION_METHODS

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_RESNET = {"depth": 10, "width_multiplier": 0.125}
TINY_VIT = {"patch": 4, "depth": 1, "heads": 2, "hidden": 16, "mlp": 16}


def _by_method(rows):
    return {row["method"]: row for row in rows}


def _assert_timed(row):
    assert row["status"] == "ok", row
    assert all(math.isfinite(s) and s > 0 for s in row["all_seconds"])
    assert math.isfinite(row["seconds"]) and row["seconds"] > 0
    assert row["peak_rss_gib"] > 0
    assert row["peak_cuda_gib"] is None  # on the CPU


def test_resnet_times_accepting_methods_and_reports_a_refusal():
    rows = speed.measure(
        ["fedavg", "git-rebasin", "regmean", "fedma"],
        arch="resnet",
        input_shape=(3, 16, 16),
        model_options=TINY_RESNET,
        fusion_samples=16,
        repeats=2,
        device="cpu",
    )
    by = _by_method(rows)
    assert list(by) == ["fedavg", "git-rebasin", "regmean", "fedma"]
    for name in ("fedavg", "git-rebasin", "regmean"):
        _assert_timed(by[name])
        assert len(by[name]["all_seconds"]) == 2
    assert "Grams" in by["regmean"]["note"]
    assert by["fedma"]["status"] == "refused"
    assert "fedma: cannot fuse resnet models" in by["fedma"]["note"]
    table = speed.format_speed_table(rows, "header")
    assert "| git-rebasin |" in table and "- fedma (refused): fedma:" in table


def test_vit_with_method_options_a_skip_and_a_failure(monkeypatch):
    def broken(self, models, inputs, target):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(FUSION_METHODS["vanilla"], "_fuse", broken)
    names = speed.resolve_methods("fedavg,kd,vanilla,fedma,kf-sites")
    rows = speed.measure(
        names,
        arch="vit",
        input_shape=(3, 16, 16),
        model_options=TINY_VIT,
        fusion_samples=16,
        device="cpu",
        options=speed.split_options(names, "kd.epochs=1 kd.patience=1"),
    )
    by = _by_method(rows)
    _assert_timed(by["fedavg"])
    _assert_timed(by["kd"])
    assert by["kd"]["note"] == "random labels"
    assert by["vanilla"]["status"] == "failed"
    assert "out of memory (simulated)" in by["vanilla"]["note"]
    assert by["fedma"]["status"] == "refused" and "vit" in by["fedma"]["note"]
    _assert_timed(by["kf-sites"])
    table = speed.format_speed_table(rows, "header")
    assert "| vanilla | FAILED |" in table


def test_methods_needing_the_sites_get_two_in_process_sites():
    rows = speed.measure(
        ["hf-sites"], arch="mlp", input_shape=(1, 4, 4), width=4, fusion_samples=8, device="cpu"
    )
    _assert_timed(rows[0])
    assert "2 sites in-process" in rows[0]["note"]


def test_several_lenets_each_site_with_its_part_of_the_fusion_set():
    rows = speed.measure(
        ["fs-merge", "hf-sites"],
        arch="lenet5",
        input_shape=(1, 28, 28),
        fusion_samples=10,
        device="cpu",
        options={"fs-merge": {"epochs": 2}},
        count=5,
    )
    for row in rows:
        _assert_timed(row)
    assert "5 sites in-process" in _by_method(rows)["hf-sites"]["note"]
    with pytest.raises(ValueError, match="count >= 2"):
        speed.measure(["fedavg"], arch="lenet5", input_shape=(1, 28, 28), count=1)


def test_all_and_options_split():
    assert speed.resolve_methods("all") == sorted(FUSION_METHODS)
    assert speed.resolve_methods("fedavg,all")[0] == "fedavg"
    with pytest.raises(ValueError, match="unknown fusion method"):
        speed.resolve_methods("fedavg,nope")
    options = speed.split_options(["fedavg", "kd", "regmean"], "epochs=2 regmean.alpha=0.5")
    assert options == {"fedavg": {}, "kd": {"epochs": 2}, "regmean": {"alpha": 0.5}}
    with pytest.raises(ValueError, match="accepted by none"):
        speed.split_options(["fedavg"], "epochs=2")


def test_cli_prints_the_table_with_the_device(capsys):
    code = main(
        [
            "speed", "--arch", "resnet", "--model-options", "depth=10 width_multiplier=0.125",
            "--input-shape", "3,16,16", "--methods", "fedavg,fedma", "--samples", "8",
            "--device", "cpu",
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "fusing 2 x resnet (blocks=[1, 1, 1, 1], stem=cifar" in out
    assert "device cpu" in out
    assert "| method | seconds (median) | peak RSS GiB | peak CUDA GiB | note |" in out
    assert "| fedavg |" in out and "- fedma (refused): fedma: cannot fuse resnet" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--width", "1e9"], "width 64000000000 is over the limit"),
        (["--arch", "mlp", "--width", "30000"], "1.89e+09 parameters, over the limit of 2e+08"),
    ],
)
def test_a_model_too_large_to_build_is_refused_before_any_allocation(capsys, argv, named):
    """`--width 1e9` ended in the allocator's raw error, asking for 6.9 TB."""
    assert main(["speed", *argv, "--methods", "fedavg", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "--width" in err


class _TinyTorchvisionResNet(nn.Module):
    """torchvision's resnet18 layout (its ``BasicBlock`` s, 7x7 stem, max-pool, ``downsample``)
    at widths 4 and 8, one block per stage: what fedfuse's own ``blocks=[1, 1]`` ResNet is at
    ``width_multiplier=0.0625`` with the ImageNet stem."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = BasicBlock(4, 4)
        shortcut = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
        self.layer2 = BasicBlock(4, 8, stride=2, downsample=shortcut)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(self.avgpool(x).flatten(1))


def test_a_plain_resnet_timed_beside_fedfuses_own_with_their_ratio(capsys, monkeypatch):
    """Issue 49: ``--arch torchvision-resnet18`` fuses the plain model and fedfuse's own ResNet
    of the same layers in turn with the same method and prints both rows and their ratio (here
    both made tiny: torchvision's blocks at widths 4 and 8, and the own ResNet to match)."""
    monkeypatch.setattr(speed_plain, "plain_factory", lambda name, classes: _TinyTorchvisionResNet)
    own = ("resnet", "blocks=[1,1] width_multiplier=0.0625 stem=imagenet")
    monkeypatch.setitem(speed_options.PLAIN_ARCHS, "torchvision-resnet18", own)
    argv = ["speed", "--arch", "torchvision-resnet18", "--samples", "8", "--input-shape",
            "3,16,16", "--device", "cpu", "--threads", "1"]  # fmt: skip
    assert main(argv) == 0  # kf-linear, the default for it
    out = capsys.readouterr().out
    plain_model = "torchvision-resnet18 (widths [4, 4, 4, 8], 1,934 parameters)"
    own_model = "resnet (blocks=[1, 1], stem=imagenet, widths [4, 4, 8], 1,934 parameters)"
    assert f"fusing 2 x {plain_model} and 2 x fedfuse's own {own_model} in turn" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| kf-linear |")]
    assert [row[1] for row in rows] == [
        "torchvision-resnet18",
        "resnet",
        "ratio torchvision-resnet18/resnet",
    ]
    plain, own_seconds, ratio = (float(row[2].rstrip("x")) for row in rows)
    assert plain > 0 and own_seconds > 0 and ratio > 0
    increases = [row[4] for row in rows]  # the RSS increases (MiB-scale here), their ratio
    assert all(cell == "-" or float(cell.rstrip("x")) >= 0 for cell in increases)


def test_torchvision_resnet18_is_adapted_with_fedfuses_resnet18_layers():
    spec = speed.benchmark_spec("torchvision-resnet18", (3, 32, 32))
    own = speed.benchmark_spec("resnet", (3, 32, 32), model_options={"stem": "imagenet"})
    assert spec.arch == "torchvision-resnet18" and spec.widths[1:] == own.widths
    assert speed.describe_spec(spec).endswith("11,181,642 parameters)")
    assert speed.describe_spec(own).endswith("11,181,642 parameters)")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model-options", "depth=10"], "has the widths its class defines"),
        (["--input-shape", "1,28,28"], "takes (3, H, W) images, got --input-shape 1,28,28"),
    ],
)
def test_the_plain_resnet18_refuses_options_it_cannot_take(capsys, argv, named):
    args = ["speed", "--arch", "torchvision-resnet18", "--device", "cpu", *argv]
    assert main(args) == 2
    assert named in capsys.readouterr().err
