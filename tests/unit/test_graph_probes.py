"""Where a derived feature space is read to align it: on the features the network passes on (what
the next Linear, Conv or attention reads), as fedfuse's own levels are, so a user's torchvision
ResNet is matched on the same costs as the same weights in fedfuse's ResNet."""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.experiments.user_models import GREY_28, OWN_SPECS, USER_MODELS, as_fedfuse_model
from fedfuse.fusion.blocks.space_alignment import capture_space, space_cost
from fedfuse.models import ModelAdapter
from fedfuse.models.capture import capture_levels
from fedfuse.models.symmetry import feature_spaces


def _resnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = USER_MODELS["resnet18"]()
    with torch.no_grad():  # BatchNorm scales of both signs, as trained nets have
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.normal_(0, 1)
                module.running_mean.normal_(0, 0.1)
    return model.eval()


def test_a_residual_stream_is_probed_where_the_next_convs_read_it_and_a_block_at_its_norm():
    adapted = ModelAdapter(USER_MODELS["resnet18"], GREY_28).adapt(_resnet(0))
    spaces = {space.name: [name for name, _ in space.probes] for space in feature_spaces(adapted)}
    # the stem's pooled output and each block's output after its ReLU: not the convs and
    # BatchNorms of the branches summed into the stream
    assert spaces["conv1"] == ["levels.3", "levels.5", "levels.7"]
    probed = [name for names in spaces.values() for name in names]
    assert not any(part in name for name in probed for part in ("conv2", "bn2", "downsample"))
    # a block's interior: what its ReLU activates (the ReLU module is shared, not capturable)
    assert spaces["layer1_0_conv1"] == ["levels.4.layer1.0.bn1"]


def test_a_torchvision_resnet_is_matched_on_the_costs_of_the_same_weights_in_fedfuses():
    sites = [_resnet(1), _resnet(2)]
    adapter = ModelAdapter(USER_MODELS["resnet18"], GREY_28)
    adapted = [adapter.adapt(site) for site in sites]
    owns = [as_fedfuse_model(site, OWN_SPECS["resnet18"]) for site in sites]
    data = torch.randn(12, *GREY_28)

    def costs(models):
        spaces = feature_spaces(models[0])
        captures = [[capture_space(m, data, s, device="cpu") for m in models] for s in spaces]
        return [space_cost(*pair) for pair in captures]

    theirs, mine = costs(adapted), costs(owns)
    assert len(theirs) == len(mine) == 12
    for cost in mine:  # every space of fedfuse's ResNet has its twin, the same costs
        assert any(
            c.shape == cost.shape and torch.allclose(c, cost, atol=1e-6 * cost.shape[0])
            for c in theirs
        )


def test_an_in_place_activation_does_not_overwrite_what_the_levels_before_it_output():
    """torchvision's ReLUs run in place; in a level they run out of place, so the BatchNorm
    level before the stem's ReLU keeps its negative outputs, and the user's module is unchanged."""
    model = _resnet(3)
    adapted = ModelAdapter(USER_MODELS["resnet18"], GREY_28).adapt(model)
    stem_norm = capture_levels(adapted, torch.randn(4, *GREY_28), [1], device="cpu")[1].outputs
    assert (stem_norm < 0).any()
    assert model.relu.inplace is True


class _ReadAgain(nn.Module):
    """An in-place ReLU whose input the code reads again: its effect is part of the function."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        y = self.act(h)  # h is now relu(h) too
        return self.fc2(y + h)


def test_an_in_place_op_whose_input_is_read_again_keeps_its_effect():
    torch.manual_seed(0)
    model = _ReadAgain().eval()
    adapted = ModelAdapter(_ReadAgain, (6,)).adapt(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        assert torch.allclose(adapted(x), model(x.clone()))
