"""A user's plain nn.Module (Flower's PyTorch template CNN) fused by fedfuse's methods and
given back as the user's own class, with the graphs it cannot align refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.experiments.plain_models import TemplateNet
from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.models import ModelAdapter, build_model, register_architecture
from fedfuse.models.capture import capture_levels
from fedfuse.models.symmetry import feature_spaces, permute_model, random_permutations


@pytest.fixture(scope="module")
def adapter() -> ModelAdapter:
    return ModelAdapter(TemplateNet, (1, 28, 28)).register()


def _inputs(n: int = 48, seed: int = 0) -> FusionInputs:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(n, 1, 28, 28, generator=generator)
    return FusionInputs(data=data, labels=torch.randint(0, 10, (n,), generator=generator))


def test_the_levels_compose_to_the_users_forward_and_share_its_parameters(adapter):
    net = TemplateNet()
    leveled = adapter.adapt(net)
    x = torch.randn(5, 1, 28, 28)
    assert torch.equal(leveled(x), net(x))
    assert adapter.spec.widths == (6, 16, 120, 84) and adapter.spec.num_classes == 10
    assert [type(leveled.levels[i]).__name__ for i in (1, 2)] == ["ReLU", "MaxPool2d"]
    assert leveled.levels[2] is not leveled.levels[5]  # one module per use (Captum)
    with torch.no_grad():
        leveled.levels[0].weight.zero_()
    assert net.conv1.weight.abs().sum() == 0


def test_names_map_both_ways_and_the_user_gets_their_class_back(adapter):
    net = TemplateNet()
    names = adapter.user_names()
    assert names["levels.0.weight"] == "conv1.weight"
    assert names["levels.6.1.bias"] == "fc1.bias"
    assert sorted(names.values()) == sorted(net.state_dict())
    back = adapter.export(adapter.adapt(net))
    assert type(back) is TemplateNet
    for key, value in net.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)
    assert type(build_model(adapter.spec, seed=3)) is not TemplateNet  # a leveled model
    assert feature_spaces(adapter.adapt(net))  # described like fedfuse's own MLP and VGG


@pytest.mark.parametrize("method", ["hf-linear", "kf-linear", "git-rebasin", "otfusion"])
def test_a_plain_model_fused_with_a_permuted_copy_keeps_its_function(adapter, method):
    torch.manual_seed(1)
    net = TemplateNet()
    leveled = adapter.adapt(net)
    permuted = adapter.export(
        permute_model(leveled, random_permutations(leveled, torch.Generator().manual_seed(2)))
    )
    assert not torch.allclose(permuted.conv1.weight, net.conv1.weight)
    # the Linear variants refit each level on the fusion set: exactly, without a ridge
    options = {"ridge": 0.0} if method.endswith("-linear") else {}
    inputs = _inputs()
    fused = make_fusion_method(method, **options).fuse([net.eval(), permuted.eval()], inputs)
    assert type(fused.model) is TemplateNet
    torch.testing.assert_close(fused.model(inputs.data), net(inputs.data), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("method", ["vanilla", "hf-gradient", "linear-probe"])
def test_other_methods_return_the_users_class(method):
    nets = [TemplateNet(), TemplateNet()]
    options = {"epochs": 1} if method != "vanilla" else {}
    if method == "hf-gradient":
        options = {"epochs": 1, "last_epochs": 1}
    fused = make_fusion_method(method, **options).fuse(nets, _inputs()).model
    assert type(fused) is TemplateNet


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(x + self.fc1(x))


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


class Softmaxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return F.log_softmax(self.fc(x), dim=1)


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.fc1(x).flip(1))


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (Softmaxed, "comes after the classifier 'fc'"),
        (Branching, "torch.fx cannot trace"),
    ],
)
def test_a_graph_fedfuse_cannot_align_is_refused_naming_the_node(cls, message):
    with pytest.raises(ValueError, match=message):
        ModelAdapter(cls, (4,))


def test_branches_and_norms_are_adapted_and_channel_mixing_is_refused_by_alignment_only():
    """A residual add and a BatchNorm are graph levels with derived spaces (the add of the
    input fixes fc1's outputs); a flip of the channels adapts, but has no feature spaces."""
    assert feature_spaces(ModelAdapter(Residual, (4,)).adapt(Residual())) == []
    norm = feature_spaces(ModelAdapter(WithBatchNorm, (4,)).adapt(WithBatchNorm()))
    assert {axis.key for axis in norm[0].axes} >= {"levels.1.norm.running_var", "levels.0.fc1.bias"}
    flipped = ModelAdapter(Transposed, (4,)).adapt(Transposed())
    with pytest.raises(ValueError, match=r"node 'flip' \(flip\)"):
        feature_spaces(flipped)


def test_plain_models_are_refused_where_fusion_would_break_them():
    nets = [TemplateNet(), TemplateNet()]
    with pytest.raises(ValueError, match="keeps the widths its class defines"):
        make_fusion_method("fedma").fuse(nets, _inputs())
    with pytest.raises(ValueError, match="needs FusionInputs.data"):
        make_fusion_method("kf-linear").fuse(nets, FusionInputs())
    with pytest.raises(TypeError, match="several classes"):
        make_fusion_method("vanilla").fuse([nets[0], Residual()], _inputs())
    with pytest.raises(ValueError, match="one of fedfuse's own architectures"):
        register_architecture("mlp", lambda spec: None)


def test_captum_scores_every_neuron_of_an_adapted_model(adapter):
    from fedfuse.models import importance_scores

    leveled = adapter.adapt(TemplateNet()).eval()
    inputs = _inputs(16)
    scores = importance_scores(leveled, inputs.data, inputs.labels, method="deeplift")
    widths = [*adapter.spec.widths, adapter.spec.num_classes]
    assert [len(scores[i]) for i in leveled.neuron_levels] == widths
    assert all(torch.isfinite(s).all() and (s >= 0).all() for s in scores.values())


class _InPlaceNet(nn.Module):
    """A chain whose activations run in place, module and function, as users often write."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.fc3 = (
            nn.Linear(6, 8),
            nn.ReLU(inplace=True),
            nn.Linear(8, 8),
            nn.Linear(8, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(self.act(self.fc1(x)))
        return self.fc3(F.relu(x, inplace=True))


def test_in_place_activations_do_not_overwrite_the_captured_outputs_of_the_level_before():
    """Each Linear level's captured outputs are its pre-activations (negatives kept), though
    the user's ReLUs run in place; the user's model keeps its in-place ReLU and its function."""
    torch.manual_seed(0)
    net = _InPlaceNet().eval()
    adapted = ModelAdapter(_InPlaceNet, (6,)).adapt(net)
    x = torch.randn(16, 6)
    captured = capture_levels(adapted, x, device="cpu")
    with torch.no_grad():
        first = net.fc1(x)
        second = net.fc2(torch.relu(first))
        expected = net(x.clone())
    linears = [i for i, level in enumerate(adapted.levels) if isinstance(level, nn.Linear)]
    assert torch.equal(captured[linears[0]].outputs, first) and (first < 0).any()
    assert torch.equal(captured[linears[1]].outputs, second) and (second < 0).any()
    assert net.act.inplace is True
    with torch.no_grad():
        assert torch.allclose(adapted(x), expected)
