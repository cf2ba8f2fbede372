"""FS-Merge on ViTs: the feature-space Foldable SuperNet (App. B), its folding and training."""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.methods.trained.fs_merge import FSMerge, head_input
from fedfuse.models import build_model, make_spec
from fedfuse.models.symmetry import permute_model, random_permutations

SPEC = make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def data() -> torch.Tensor:
    return torch.randn(24, 1, 28, 28, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def base():
    return build_model(SPEC, seed=0).eval()


@pytest.fixture
def twin(base):
    """A copy of ``base`` with every feature space permuted (heads kept as groups)."""
    return permute_model(base, random_permutations(base, torch.Generator().manual_seed(3))).eval()


def test_check_run_accepts_vit_and_refuses_what_is_not_supported():
    FSMerge().check_run(2, SPEC)
    FSMerge(init="first").check_run(3, SPEC)
    with pytest.raises(ValueError, match="global objective only"):
        FSMerge(objective="local").check_run(2, SPEC)
    resnet = make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=1 / 8)
    with pytest.raises(ValueError, match="BatchNorm"):
        FSMerge().check_run(2, resnet)


def test_matching_init_of_a_vit_and_its_permuted_copy_keeps_the_function(base, twin, data):
    assert torch.allclose(base(data), twin(data), atol=1e-5)  # the copy computes the same
    result = FSMerge(init="zipit", rank=4, epochs=0).fuse([base, twin], FusionInputs(data=data))
    fused = result.model
    assert fused.spec == SPEC
    with torch.no_grad():
        assert torch.allclose(fused(data), base(data), atol=1e-4)
    assert result.details["loss"]["initial"] < 1e-8
    # without matching the permuted features are averaged with the wrong twins: broken
    naive = FSMerge(init="average", rank=4, epochs=0).fuse([base, twin], FusionInputs(data=data))
    with torch.no_grad():
        assert (naive.model(data) - base(data)).abs().max() > 0.1
    assert naive.details["loss"]["initial"] > 0.1


def test_first_init_folds_back_to_model_zero(base, data):
    other = build_model(SPEC, seed=1).eval()
    method = FSMerge(init="first", head="first", rank=4, epochs=0)
    fused = method.fuse([base, other], FusionInputs(data=data)).model
    for key, value in base.state_dict().items():
        assert torch.allclose(fused.state_dict()[key], value, atol=1e-6), key


def test_the_folded_model_computes_what_the_supernet_computes(base, data):
    models = [base, build_model(SPEC, seed=1).eval(), build_model(SPEC, seed=2).eval()]
    generator = torch.Generator().manual_seed(5)
    net = FSMerge(init="average", rank=3).space_supernet(models, data, generator)
    with torch.no_grad():  # move away from the initialisation: diagonals and low-rank factors
        for parameter in net.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    features, logits = net(data)
    folded = net.fold()
    with torch.no_grad():
        assert torch.allclose(folded(data), logits, atol=1e-5)
        assert torch.allclose(head_input(folded, data), features, atol=1e-5)
    # the reconstruction is every model's head input, read off the merged one by U_head
    assert net.reconstruction(data).shape == (len(data), 3 * SPEC.widths[0])
    # gradients reach every merge/unmerge matrix and the merged LayerNorms
    net.reconstruction(data).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_the_global_objective_decreases_and_the_bases_stay_untouched(base, data):
    other = build_model(SPEC, seed=1).eval()
    before = [copy.deepcopy(m.state_dict()) for m in (base, other)]
    method = FSMerge(init="first", rank=4, epochs=8, optimizer="adam", lr=1e-2, eval_points=8)
    result = method.fuse([base, other], FusionInputs(data=data))
    info = result.details["training"]
    assert info["best_loss"] < 0.8 * info["initial_loss"]
    assert result.details["supernet"] == "feature spaces"
    assert result.model.spec == SPEC
    for model, state in zip((base, other), before, strict=True):
        for key, value in model.state_dict().items():
            assert torch.equal(value, state[key])
    # the fused model is an ordinary model of the base spec: it loads into a fresh one
    fresh = build_model(SPEC, seed=9)
    fresh.load_state_dict(result.model.state_dict())
    with torch.no_grad():
        assert torch.allclose(fresh.eval()(data), result.model(data))
