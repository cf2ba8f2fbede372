"""The symmetry of a user's model derived from its torch.fx graph: torchvision ResNets and ViTs,
a CNN with BatchNorm, a residual CNN, a cat of two branches; each random permutation of every
derived space keeps the function, the fused model goes back into the user's class, and a model
whose channels cannot be aligned is refused in one line by alignment methods only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import VisionTransformer, resnet18
from torchvision.models.resnet import BasicBlock, ResNet

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.models import ModelAdapter
from fedfuse.models.symmetry import feature_spaces, permute_model, random_permutations


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12)
        self.fc = nn.Linear(12 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


class ResidualCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = x + self.conv2(F.relu(self.conv1(x)))
        return self.fc(self.pool(F.relu(self.norm(x))).flatten(1))


class Branches(nn.Module):
    """Two convolutions of one input concatenated on the channels, then a LayerNorm'd head."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 6, 3, padding=1)
        self.mix = nn.Conv2d(10, 8, 1)
        self.fc1, self.ln, self.fc2 = nn.Linear(8 * 4, 16), nn.LayerNorm(16), nn.Linear(16, 10)

    def forward(self, x):
        x = torch.cat([F.relu(self.left(x)), torch.tanh(self.right(x))], dim=1)
        x = F.adaptive_avg_pool2d(self.mix(x), 2)
        return self.fc2(F.gelu(self.ln(self.fc1(x.view(x.size(0), -1)))))


class Mixing(nn.Module):
    """A custom op that rolls the hidden channels: no permutation of them keeps the function."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 6, 3), nn.Linear(6, 10)

    def forward(self, x):
        x = self.conv(x).roll(1, dims=1)
        return self.fc(x.mean((2, 3)))


def _small_resnet() -> nn.Module:
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _vit() -> nn.Module:
    return VisionTransformer(28, 7, 2, 2, 32, 64, num_classes=10)


MODELS = {
    "bn-cnn": (BatchNormCNN, (1, 28, 28)),
    "residual-cnn": (ResidualCNN, (1, 28, 28)),
    "branches": (Branches, (1, 8, 8)),
    "resnet-1111": (_small_resnet, (3, 16, 16)),
    "resnet18": (lambda: resnet18(num_classes=10), (3, 16, 16)),
    "vit": (_vit, (3, 28, 28)),
}
ADAPTERS: dict[str, ModelAdapter] = {}


def _adapter(name: str) -> ModelAdapter:
    if name not in ADAPTERS:
        factory, shape = MODELS[name]
        ADAPTERS[name] = ModelAdapter(factory, shape, name=f"test-{name}").register()
    return ADAPTERS[name]


def _trained_like(name: str, seed: int = 0) -> nn.Module:
    """A model with non-trivial BatchNorm statistics and affine terms (and a ViT head, which
    torchvision initialises at zero), in eval mode."""
    factory, shape = MODELS[name]
    torch.manual_seed(seed)
    model = factory()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d | nn.GroupNorm | nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
        if isinstance(model, VisionTransformer):
            nn.init.normal_(model.heads.head.weight, std=0.2)
        model.train()
        model(torch.randn(4, *shape))
    return model.eval()


def _data(name: str, n: int = 32, seed: int = 0) -> FusionInputs:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(n, *MODELS[name][1], generator=generator)
    return FusionInputs(data=data, labels=torch.randint(0, 10, (n,), generator=generator))


@pytest.mark.parametrize("name", [name for name in MODELS if name != "resnet-1111"])
def test_every_derived_space_permuted_keeps_the_function_and_goes_back_into_the_users_class(
    name,
):
    adapter = _adapter(name)
    net = _trained_like(name)
    leveled = adapter.adapt(net)
    x = _data(name, 4).data
    with torch.no_grad():
        expected = net(x)
        torch.testing.assert_close(leveled(x), expected)
        spaces = feature_spaces(leveled)
        assert spaces and all(space.probes for space in spaces)
        permuted = permute_model(leveled, random_permutations(leveled, torch.Generator()))
        torch.testing.assert_close(permuted(x), expected, atol=1e-5, rtol=1e-4)
        fresh = MODELS[name][0]()
        fresh.load_state_dict(adapter.export(permuted).state_dict(), strict=True)
        torch.testing.assert_close(fresh.eval()(x), expected, atol=1e-5, rtol=1e-4)
    moved = {space.name for space in spaces}
    changed = [
        k for k, v in permuted.state_dict().items() if not torch.equal(v, leveled.state_dict()[k])
    ]
    assert changed and moved


def test_the_spaces_follow_residual_streams_attention_heads_and_concatenated_parts():
    resnet = {s.name: s for s in feature_spaces(_adapter("resnet-1111").adapt(_small_resnet()))}
    stem = resnet["conv1"]  # the stem and layer1's block outputs: one stream
    assert {"levels.1.bn1.running_mean", "levels.4.layer1.0.bn2.weight"} <= stem.keys
    assert "levels.14.fc.weight" not in stem.keys  # layer1 feeds layer2, not the classifier
    vit = {s.name: s for s in feature_spaces(_adapter("vit").adapt(_vit()))}
    heads = [s for name, s in vit.items() if name.endswith(".qk")]
    assert len(heads) == 2 and all(s.groups == 2 and len(s.probes) == 2 for s in heads)
    stream = vit["conv_proj"]
    assert any(k.endswith("class_token") for k in stream.keys)
    assert any(k.endswith("pos_embedding") for k in stream.keys)
    assert not any("heads.head.bias" in k for s in vit.values() for k in s.keys)
    branches = {s.name: s for s in feature_spaces(_adapter("branches").adapt(Branches()))}
    offsets = {
        a.offset
        for s in branches.values()
        for a in s.axes
        if a.key.endswith("mix.weight") and not a.produces
    }
    assert offsets == {0, 4}  # the cat's two parts, each a slice of the next conv's inputs


def test_a_model_whose_channels_cannot_be_aligned_is_refused_in_one_line_and_still_averaged():
    adapter = ModelAdapter(Mixing, (1, 8, 8), name="test-mixing").register()
    with pytest.raises(ValueError, match=r"node 'roll' \(roll\)") as refused:
        make_fusion_method("git-rebasin").check_run(2, adapter.spec)
    assert "\n" not in str(refused.value) and "git-rebasin" in str(refused.value)
    # a level-by-level fit reads the fused level's inputs as the roll leaves them: no alignment
    make_fusion_method("kf-linear").check_run(2, adapter.spec)
    nets = [Mixing(), Mixing()]
    inputs = _data("branches", 16)
    inputs = FusionInputs(data=inputs.data[:, :1], labels=inputs.labels, sample_counts=[3, 1])
    fused = make_fusion_method("fedavg").fuse(nets, inputs).model
    assert type(fused) is Mixing
    expected = (nets[0].conv.weight * 3 + nets[1].conv.weight) / 4
    torch.testing.assert_close(fused.conv.weight, expected)
    distilled = make_fusion_method("kd", epochs=1, batch_size=16).fuse(nets, inputs).model
    assert type(distilled) is Mixing


@pytest.mark.parametrize("name", ["bn-cnn", "vit"])
def test_git_rebasin_of_a_permuted_copy_recovers_the_function(name):
    adapter = _adapter(name)
    net = _trained_like(name)
    leveled = adapter.adapt(net)
    generator = torch.Generator().manual_seed(3)
    permuted = adapter.export(permute_model(leveled, random_permutations(leveled, generator)))
    inputs = _data(name, 24)
    method = make_fusion_method("git-rebasin", reset_batchnorm=False, weighted_average=False)
    fused = method.fuse([net, permuted.eval()], inputs).model
    assert type(fused) is type(net)
    with torch.no_grad():
        torch.testing.assert_close(
            fused.eval()(inputs.data), net(inputs.data), atol=1e-4, rtol=1e-3
        )
