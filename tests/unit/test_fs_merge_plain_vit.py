"""FS-Merge and ZipIt on a user's own Vision Transformer (issue 49): torchvision's
``VisionTransformer`` given as a plain model is merged on the feature spaces read off its traced
graph (the packed attention projection's query, key and value rows each their own site), the
classifier's input reconstructed, and the result comes back as the user's class."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.trained.fs_merge import FSMerge
from fedfuse.models import ModelAdapter
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import SmallViT, prototype_task, trained_small_vit

SHAPE = (1, 28, 28)
CLASSES = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sites():
    return [trained_small_vit(0), trained_small_vit(1)]


@pytest.fixture(scope="module")
def data():
    return prototype_task(64, 99, SHAPE, CLASSES)[0]


def _loads_strictly(model: nn.Module) -> SmallViT:
    assert type(model) is SmallViT
    fresh = SmallViT()
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh.eval()


@pytest.mark.parametrize("method", ["fs-merge", "zipit"])
def test_check_run_accepts_the_user_vit(method):
    spec = ModelAdapter(SmallViT, SHAPE).register().spec
    make_fusion_method(method).check_run(2, spec)


def test_zipit_of_a_user_vit_and_its_permuted_copy_keeps_the_function(sites, data):
    adapter = ModelAdapter(SmallViT, SHAPE)
    adapted = adapter.adapt(sites[0])
    twin = adapter.export(
        permute_model(adapted, random_permutations(adapted, torch.Generator().manual_seed(3)))
    ).eval()
    with torch.no_grad():
        assert torch.allclose(twin(data), sites[0](data), atol=1e-4)
    result = make_fusion_method("zipit").fuse([sites[0], twin], FusionInputs(data=data))
    fused = _loads_strictly(result.model)
    with torch.no_grad():
        assert torch.allclose(fused(data), sites[0](data), atol=1e-3)
    assert result.details["loss"]["initial"] < 1e-6


def test_fs_merge_returns_the_users_class_and_beats_averaging(sites, data):
    inputs = FusionInputs(data=data)
    before = [{k: v.clone() for k, v in site.state_dict().items()} for site in sites]
    averaged = FSMerge(init="average", rank=4, epochs=0).fuse(sites, inputs)
    merged = FSMerge(rank=4, epochs=40).fuse(sites, inputs)
    fused = _loads_strictly(merged.model)
    with torch.no_grad():
        assert torch.allclose(fused(data), merged.model(data))
    vanilla = averaged.details["loss"]["initial"]
    final = merged.details["loss"]["final"]
    print(f"reconstruction loss: averaging {vanilla:.4f}, fs-merge {final:.4f}")
    assert final < 0.8 * vanilla
    # vanilla averaging is what the "average" initialisation folds to, weight by weight
    for key, value in averaged.model.state_dict().items():
        mean = (sites[0].state_dict()[key] + sites[1].state_dict()[key]) / 2
        assert torch.allclose(value, mean, atol=1e-5), key
    # the bases are untouched
    for site, state in zip(sites, before, strict=True):
        assert all(torch.equal(v, state[k]) for k, v in site.state_dict().items())
