"""The Linear fit's ridge prior: the base models' own weights where the fusion rows do not span a
level's inputs (``fedfuse.fusion.methods.neuron_interpolation.prior``)."""

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.neuron_interpolation.prior import (
    aligned_weight_centres,
    has_plain_levels,
)
from fedfuse.models import build_model, make_spec, mlp_spec
from tests.helpers import permuted_copy

SHAPE = (1, 8, 8)  # 64 inputs: more than the fusion rows below, on every level


def _data(n, seed):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def mlp():
    return build_model(mlp_spec(SHAPE, 3, (16, 12)), seed=0).eval()


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_a_permuted_copy_is_reproduced_off_the_fusion_rows_span(mlp, method):
    """10 fusion rows span 10 of each level's 13-65 inputs. Fitted towards zero, the fused model
    matches the pair on those rows only; towards the aligned weights, on every input."""
    other = permuted_copy(mlp, seed=1)
    inputs = FusionInputs(data=_data(10, seed=0))
    test = _data(50, seed=9)
    fused = {
        prior: make_fusion_method(method, ridge_prior=prior, ridge=ridge).fuse([mlp, other], inputs)
        for prior, ridge in (("auto", None), ("aligned", None), ("zero", 0.0))
    }
    for prior in ("auto", "aligned"):
        assert torch.allclose(fused[prior].model(test), mlp(test), atol=1e-4), prior
    assert [level["prior"] for level in fused["auto"].details["levels"]] == ["aligned"] * 3
    on_rows = fused["zero"].model(inputs.data) - mlp(inputs.data)
    assert on_rows.abs().max() < 1e-4  # the paper's exact fit reaches the rows' targets...
    assert (fused["zero"].model(test) - mlp(test)).abs().max() > 1e-2  # ...and no further
    assert "prior" not in fused["zero"].details["levels"][0]


def test_with_more_rows_than_inputs_the_prior_changes_nothing(mlp):
    """The gram route (rows >= fan-in) sees every input direction: no prior is applied."""
    sites = [mlp, build_model(mlp.spec, seed=1).eval()]
    inputs = FusionInputs(data=_data(120, seed=0))
    fused = [
        make_fusion_method("kf-linear", ridge_prior=prior).fuse(sites, inputs).model
        for prior in ("aligned", "zero")
    ]
    for a, b in zip(fused[0].parameters(), fused[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_prior_sums_each_models_inputs_into_their_groups_below():
    """Model inputs grouped one level down (``below``) are summed into the fused input of their
    group, position by position; the bias is the last column where the design has an
    intercept. Each base neuron its own group here, so the centres are the weights themselves."""
    first = nn.Sequential(nn.Flatten(), nn.Linear(3 * 2, 2))
    second = nn.Sequential(nn.Flatten(), nn.Linear(2 * 2, 1, bias=False))
    fused = nn.Sequential(nn.Flatten(), nn.Linear(2 * 2, 5))  # 2 groups below, 2 positions each
    below = (torch.tensor([1, 0, 1, 0, 0]), [3, 2], 2)  # model 0: 3 channels, model 1: 2
    own = (torch.ones(3), torch.arange(3), 3)  # weights, labels, k: a group per neuron
    centres = aligned_weight_centres([first, second], below, fused, True, *own)
    w0 = first[1].weight.detach().double().reshape(2, 3, 2)
    w1 = second[1].weight.detach().double().reshape(1, 2, 2)
    bias = first[1].bias.detach().double()[:, None]
    assert centres.shape == (3, 2 * 2 + 1)
    assert torch.allclose(centres[:2], torch.cat([w0[:, 1], w0[:, 0] + w0[:, 2], bias], 1))
    assert torch.allclose(centres[2:, :2], w1[:, 0] + w1[:, 1])  # both channels in group 0
    assert not centres[2:, 2:].any()  # nothing in group 1, no bias
    # one group of both neurons of model 0, weighted 1 : 3
    pair = aligned_weight_centres(
        [first], below, fused, True, torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), 1
    )
    assert torch.allclose(pair[0], (centres[0] + 3 * centres[1]) / 4)
    # on the raw input the weights are the layer's own; a fan-in that does not split is refused
    raw = aligned_weight_centres([fused], None, fused, False, torch.ones(5), torch.arange(5), 5)
    assert torch.equal(raw, fused[1].weight.detach().double())
    split = (below[0][:3], [3], 3)
    assert aligned_weight_centres([first], split, fused, False, *own) is None


def test_only_plain_stacks_have_a_prior(mlp):
    resnet = build_model(
        make_spec("resnet", (3, 16, 16), 10, depth=10, width_multiplier=0.125), seed=0
    )
    assert has_plain_levels(mlp)
    assert not has_plain_levels(resnet)


def test_ridge_prior_is_one_of_its_choices():
    with pytest.raises(ValueError, match="ridge_prior must be one of"):
        make_fusion_method("kf-linear", ridge_prior="mean")
