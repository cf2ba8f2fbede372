"""The closed-form neuron-interpolation methods on a user's own ResNet (issue 49, item 2): a
conv with its BatchNorm, torchvision's ``BasicBlock`` with an identity shortcut or a
``downsample`` of conv and BatchNorm, read off the traced graph as linear pieces, fitted on the
fusion set (``kf-linear``, ``hf-linear``) or on the sites' own data (``kf-sites``, ``hf-sites``,
statistics rounds, and ``kf-trust``)."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels, read_block
from fedfuse.models import ModelAdapter
from tests.helpers import prototype_task, trained_on_prototypes

SHAPE = (1, 16, 16)
CLASSES = 4


class SmallResNet(nn.Module):
    """A torchvision-style ResNet: stem conv-BN-ReLU, an identity block, a downsampling block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        downsample = nn.Sequential(
            nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), nn.BatchNorm2d(2 * width)
        )
        self.layer1 = nn.Sequential(
            BasicBlock(width, width), BasicBlock(width, 2 * width, 2, downsample)
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _task(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return prototype_task(samples, seed, SHAPE, CLASSES)


def _trained(seed: int) -> SmallResNet:
    torch.manual_seed(seed)
    return trained_on_prototypes(SmallResNet(), seed, SHAPE, CLASSES, lr=0.01, steps=32)


@pytest.fixture(scope="module")
def sites():
    return [_trained(0), _trained(1)]


@pytest.fixture(scope="module")
def fusion_set():
    return _task(160, 99)


def _site_data(seed: int) -> torch.Tensor:
    """The inputs a site trained on (``_trained``'s)."""
    return _task(256, seed)[0]


def test_the_levels_are_read_as_pieces_and_the_identity_blocks_as_residual():
    adapted = ModelAdapter(SmallResNet, SHAPE).adapt(SmallResNet())
    view, where = fold_norm_levels(adapted)
    assert where[0] == where[1] == 0  # conv1 and its BatchNorm level: one level
    assert [view.level_name(i) for i in view.neuron_levels] == [
        "0:conv1+bn1",
        "2:layer1.0",
        "4:layer1.1",
        "8:fc",
    ]
    blocks = [read_block(view.levels[i]) for i in view.neuron_levels]
    assert all(block is not None for block in blocks)
    assert [view.is_residual(i) for i in view.neuron_levels] == [False, True, False, False]
    joint = blocks[2].outputs  # conv2 fitted with the downsample, two BatchNorms folded
    assert [(u.layer, u.norm) for u in joint] == [
        ("layer1.1.conv2", "layer1.1.bn2"),
        ("layer1.1.downsample.0", "layer1.1.downsample.1"),
    ]
    x = torch.randn(3, *SHAPE)
    assert torch.equal(view.eval()(x), adapted.eval()(x))


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_fusing_identical_copies_gives_the_model_back(sites, fusion_set, method):
    model = sites[0]
    copy = SmallResNet()
    copy.load_state_dict(model.state_dict())
    data = fusion_set[0]
    method = make_fusion_method(method, use_scores=False)
    fused = method.fuse([model, copy.eval()], FusionInputs(data)).model
    assert type(fused) is SmallResNet
    with torch.no_grad():
        expected, got = model(data), fused.eval()(data)
    assert torch.allclose(got, expected, atol=1e-3 * float(expected.abs().max()))


def test_statistics_rounds_on_identical_copies_give_the_model_back(sites):
    model, copy = sites[0], SmallResNet()
    copy.load_state_dict(model.state_dict())
    data = _site_data(0)
    rounds = LocalSites([model, copy.eval()], [data, data])
    method = make_fusion_method("kf-sites", use_scores=False)
    fused = method.fuse([model, copy.eval()], FusionInputs(sites=rounds)).model
    assert type(fused) is SmallResNet
    with torch.no_grad():
        expected, got = model(data), fused.eval()(data)
    assert torch.allclose(got, expected, atol=1e-3 * float(expected.abs().max()))


#: a gradient variant starts from the same closed-form fit (1 epoch: the test stays short)
STARTED = {"start": "closed-form", "epochs": 1, "last_epochs": 1}


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("kf-linear", {}),
        ("hf-linear", {}),
        ("kf-gradient", STARTED),
        ("kf-sites", {}),  # each site's statistics of its own training data
        ("hf-sites", {}),
        ("kf-trust", {}),  # the fusion set's rows, each fitted to the models that know it
    ],
)
def test_two_sites_fuse_into_the_users_class_better_than_averaging(
    sites, fusion_set, method, options
):
    data, labels = fusion_set
    rounds = LocalSites(sites, [_site_data(0), _site_data(1)])
    inputs = FusionInputs(data, labels=labels, sites=rounds)
    fused = make_fusion_method(method, **options).fuse(sites, inputs).model
    fresh = SmallResNet()
    fresh.load_state_dict(fused.state_dict())  # strict: the user's names and shapes
    averaged = make_fusion_method("vanilla").fuse(sites, inputs).model
    with torch.no_grad():
        logits = fresh.eval()(data)
        loss = nn.functional.cross_entropy(logits, labels)
        average_loss = nn.functional.cross_entropy(averaged.eval()(data), labels)
        site_losses = [nn.functional.cross_entropy(s(data), labels) for s in sites]
    assert torch.isfinite(logits).all()
    assert max(site_losses) < 0.6 * average_loss  # the sites disagree: averaging hurts
    # kf-linear 0.50, hf-linear 0.57, kf-sites 0.59, hf-sites 0.53, kf-trust 0.58 against 1.25
    assert loss < 0.6 * average_loss


RESNETS = {  # torchvision's own classes; their identity blocks are read as residual levels
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=10),
        ["layer1.0", "layer1.1", "layer2.1", "layer3.1", "layer4.1"],
    ),
    "bottleneck": (  # three convs on the main path, every block with a downsample
        lambda: ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10),
        [],
    ),
}


@pytest.mark.parametrize("name", list(RESNETS))
def test_torchvision_resnets_are_taken_by_the_closed_form_variants(name):
    build, residual_blocks = RESNETS[name]
    adapter = ModelAdapter(build, (3, 32, 32), name=f"test-{name}").register()
    for method in ("kf-linear", "hf-linear", "kf-sites", "hf-sites", "kf-trust", "hf-trust"):
        make_fusion_method(method).check_run(2, adapter.spec)
    adapted = adapter.adapt(build().eval())
    view, _ = fold_norm_levels(adapted)
    assert all(read_block(view.levels[i]) is not None for i in view.neuron_levels)
    residual = [view.level_name(i) for i in view.neuron_levels if view.is_residual(i)]
    assert [label.split(":")[1] for label in residual] == residual_blocks
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(view(x), adapted(x))


class _ReluBeforeAdd(nn.Module):
    """A block whose branch is activated before the add: no linear piece reproduces it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, x):
        x = self.conv1(x).relu()
        x = x + self.norm(self.conv2(x))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("method", ["kf-linear", "kf-sites"])
def test_a_level_of_other_ops_is_refused_naming_the_level_and_the_op(method):
    spec = ModelAdapter(_ReluBeforeAdd, SHAPE).register().spec
    with pytest.raises(ValueError, match=r"level 2:.*node 'norm', GroupNorm") as error:
        make_fusion_method(method).check_run(2, spec)
    assert "\n" not in str(error.value)
