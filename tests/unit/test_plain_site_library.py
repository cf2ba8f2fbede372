"""The library on the user's own plain modules without Flower: LocalSites takes them, the public
site_fusion_inputs computes what the methods read from the sites, and methods without a fusion
set (fedavg, regmean on site Grams, kf-sites) need no FusionInputs.data for the input shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.federation import site_fusion_inputs
from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.base import plain_model_adapter


class SmallNet(nn.Module):
    """A tiny CNN with BatchNorm, as users write them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(x, 1))


class ChainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 26 * 26, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def _nets(cls: type[nn.Module]) -> list[nn.Module]:
    nets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        nets.append(cls().eval())
    return nets


def _site(seed: int, shape: tuple[int, ...] = (1, 8, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(24, *shape, generator=generator), torch.arange(24) % 3


class SmallChain(ChainNet):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4 * 6 * 6, 3)


def test_local_sites_take_plain_modules_and_kf_sites_fuses_them_without_a_fusion_set():
    nets = _nets(SmallChain)
    sites = LocalSites(nets, [_site(0)[0], _site(1)[0]])
    assert sites.input_shape == (1, 8, 8)
    fused = make_fusion_method("kf-sites").fuse(nets, FusionInputs(sites=sites)).model
    assert type(fused) is SmallChain
    assert fused(torch.zeros(2, 1, 8, 8)).shape == (2, 3)


def test_site_fusion_inputs_give_regmean_its_grams_and_no_fusion_set_is_needed():
    nets = _nets(SmallChain)
    inputs = site_fusion_inputs(nets, [_site(0), _site(1)], "regmean,fedavg")
    assert inputs.data is None and inputs.sample_counts == [24, 24]
    assert inputs.grams is not None and len(inputs.grams) == 2
    for name in ("regmean", "fedavg"):
        fused = make_fusion_method(name).fuse(nets, inputs).model
        assert type(fused) is SmallChain
        SmallChain().load_state_dict(fused.state_dict())


def test_site_fusion_inputs_compute_scores_class_counts_and_fisher():
    nets = _nets(SmallNet)
    inputs = site_fusion_inputs(nets, [_site(0), _site(1)], "kf-linear,fisher-merging")
    assert inputs.class_counts == [[8, 8, 8], [8, 8, 8]]
    assert inputs.scores is not None and inputs.fisher is not None and len(inputs.fisher) == 2


def test_fedavg_reads_the_input_shape_off_a_plain_model():
    nets = _nets(ChainNet)  # conv first, then a Linear fixing the side at 28
    fused = make_fusion_method("fedavg").fuse(nets, FusionInputs(sample_counts=[1, 1])).model
    expected = (nets[0].fc.weight + nets[1].fc.weight) / 2
    assert type(fused) is ChainNet and torch.allclose(fused.fc.weight, expected)


def test_a_model_whose_shape_cannot_be_told_says_what_to_give():
    class Odd(ChainNet):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4 * 25 * 27, 3)  # no square side fits

    with pytest.raises(ValueError, match=r"FusionInputs.data.*ModelAdapter\(Odd, input_shape\)"):
        plain_model_adapter(_nets(Odd), FusionInputs())
