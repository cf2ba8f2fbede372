"""RegMean anchored on the fusion set (``regmean-fs``): identical sites give the site back, a
permuted copy is aligned back, the site term is RegMean's (a huge weight gives RegMean, sites
sharing a model fit as their pooled Grams), the weight is chosen by held-out loss, broken
uploads and block models are refused with their names."""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.federation.uploads import needs_grams
from fedfuse.fusion import RegMean, RegMeanFusionSet
from fedfuse.fusion.inputs import FusionInputs
from fedfuse.fusion.methods.regression.regmean_fusion_set import WEIGHT_GRID
from fedfuse.fusion.statistics.grams import level_grams
from fedfuse.models import build_model, lenet5_spec, mlp_spec, resnet_spec
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import randn

MLP = mlp_spec((1, 3, 3), 3, (7, 6))
LENET = lenet5_spec((1, 12, 12), 3, widths=(3, 4, 6, 5))


def _fusion_set(spec, seed: int = 5, n: int = 30) -> FusionInputs:
    data = randn(seed, n, *spec.input_shape)
    return FusionInputs(data=data, labels=torch.arange(n) % spec.num_classes)


def _with_grams(models, data, fusion: FusionInputs) -> FusionInputs:
    grams = [level_grams(m, d) for m, d in zip(models, data, strict=True)]
    return FusionInputs(data=fusion.data, labels=fusion.labels, grams=grams)


def _outputs(model, spec):
    with torch.no_grad():
        return model.eval()(randn(12, 16, *spec.input_shape))


@pytest.mark.parametrize("align", ["activations", "none"])
@pytest.mark.parametrize("spec", [MLP, LENET], ids=["mlp", "lenet"])
def test_sites_that_all_hold_the_same_model_get_it_back(spec, align):
    model = build_model(spec, seed=3).eval()
    data = [randn(k, 25, *spec.input_shape) for k in range(3)]
    copies = [copy.deepcopy(model) for _ in data]
    inputs = _with_grams(copies, data, _fusion_set(spec))
    fused = RegMeanFusionSet(align=align, folds=3).fuse(copies, inputs).model
    torch.testing.assert_close(_outputs(fused, spec), _outputs(model, spec), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", [MLP, LENET], ids=["mlp", "lenet"])
def test_a_model_fused_with_its_permuted_copy_keeps_its_function(spec):
    model = build_model(spec, seed=0).eval()
    permuted = permute_model(model, random_permutations(model, torch.Generator().manual_seed(1)))
    data = [randn(10, 40, *spec.input_shape), randn(11, 30, *spec.input_shape)]
    inputs = _with_grams([model, permuted], data, _fusion_set(spec))
    fused = RegMeanFusionSet(weight=1.0, align="activations").fuse([model, permuted], inputs).model
    torch.testing.assert_close(_outputs(fused, spec), _outputs(model, spec), rtol=1e-4, atol=1e-4)


def test_a_huge_site_weight_gives_regmean_without_shrinkage():
    sites = [build_model(MLP, seed=s).eval() for s in (0, 1)]
    data = [randn(20 + k, 60, *MLP.input_shape) for k in range(2)]
    inputs = _with_grams(sites, data, _fusion_set(MLP))
    anchored = RegMeanFusionSet(weight=1e9, align="none", jitter=0.0).fuse(sites, inputs).model
    plain = RegMean(alpha=1.0, jitter=0.0).fuse(sites, inputs).model
    torch.testing.assert_close(_outputs(anchored, MLP), _outputs(plain, MLP), rtol=1e-4, atol=1e-4)


def test_sites_sharing_a_model_fit_as_their_pooled_grams():
    shared, other = build_model(MLP, seed=0).eval(), build_model(MLP, seed=1).eval()
    data = [randn(30 + k, 40, *MLP.input_shape) for k in range(3)]
    fusion = _fusion_set(MLP)
    apart = _with_grams([shared, copy.deepcopy(shared), other], data, fusion)
    pooled_data = [torch.cat(data[:2]), data[2]]
    pooled = _with_grams([shared, other], pooled_data, fusion)
    # the targets weigh each model by its belief in the label: a duplicated model counts twice
    # there, so compare the site term alone (weight -> infinity)
    method = RegMeanFusionSet(weight=1e9, align="none", jitter=0.0)
    three = method.fuse([shared, copy.deepcopy(shared), other], apart).model
    two = method.fuse([shared, other], pooled).model
    torch.testing.assert_close(_outputs(three, MLP), _outputs(two, MLP), rtol=1e-4, atol=1e-4)


def test_auto_picks_the_alignment_and_weight_of_least_held_out_loss():
    sites = [build_model(MLP, seed=s).eval() for s in (0, 1)]
    data = [randn(20 + k, 60, *MLP.input_shape) for k in range(2)]
    result = RegMeanFusionSet(folds=3).fuse(sites, _with_grams(sites, data, _fusion_set(MLP)))
    losses = result.details["held_out_losses"]
    assert sorted(losses) == sorted(
        f"{a} {w:g}" for a in ("activations", "none") for w in WEIGHT_GRID
    )
    chosen = f"{result.details['align']} {result.details['weight']:g}"
    assert losses[chosen] == min(losses.values())


def test_a_permuted_copy_is_recognised_by_its_held_out_loss():
    model = build_model(MLP, seed=0).eval()
    permuted = permute_model(model, random_permutations(model, torch.Generator().manual_seed(1)))
    data = [randn(10, 40, *MLP.input_shape), randn(11, 30, *MLP.input_shape)]
    inputs = _with_grams([model, permuted], data, _fusion_set(MLP))
    assert RegMeanFusionSet().fuse([model, permuted], inputs).details["align"] == "activations"


def test_a_broken_gram_is_named_with_its_site_and_level():
    sites = [build_model(MLP, seed=s).eval() for s in (0, 1)]
    data = [randn(20 + k, 60, *MLP.input_shape) for k in range(2)]
    inputs = _with_grams(sites, data, _fusion_set(MLP))
    level = sites[1].neuron_levels[1]
    inputs.grams[1][level] = torch.full_like(inputs.grams[1][level], float("nan"))
    with pytest.raises(ValueError, match=r"site 1, level .*finite"):
        RegMeanFusionSet(weight=1.0).fuse(sites, inputs)


def test_it_asks_for_grams_and_refuses_blocks_before_any_site_trains():
    method = RegMeanFusionSet()
    assert needs_grams([method])
    assert method.requirements() >= {"grams", "data", "labels"}
    with pytest.raises(ValueError, match="regmean-fs.*not affine"):
        method.check_run(2, resnet_spec((3, 8, 8), 3, depth=10, width_multiplier=1 / 16))
    with pytest.raises(ValueError, match="weight"):
        RegMeanFusionSet(weight=-1.0)
    with pytest.raises(ValueError, match="align"):
        RegMeanFusionSet(align="hungarian")


def test_a_fusion_set_missing_a_class_the_sites_hold_falls_back_to_the_sites_term(caplog):
    sites = [build_model(MLP, seed=s).eval() for s in (0, 1)]
    data = [randn(20 + k, 60, *MLP.input_shape) for k in range(2)]
    fusion = _fusion_set(MLP)
    shown = fusion.labels != 2  # class 2 only on the sites
    inputs = _with_grams(
        sites, data, FusionInputs(data=fusion.data[shown], labels=fusion.labels[shown])
    )
    inputs.class_counts = [[5, 5, 0], [0, 5, 5]]
    with caplog.at_level("WARNING"):
        result = RegMeanFusionSet(align="none").fuse(sites, inputs)
    assert result.details["weight"] == float("inf") and result.details["unseen_classes"] == [2]
    assert "classes [2]" in caplog.text
    alone = RegMeanFusionSet(weight=float("inf"), align="none", jitter=0.0).fuse(sites, inputs)
    plain = RegMean(alpha=1.0, jitter=0.0).fuse(sites, inputs).model
    torch.testing.assert_close(
        _outputs(alone.model, MLP), _outputs(plain, MLP), rtol=1e-4, atol=1e-4
    )
