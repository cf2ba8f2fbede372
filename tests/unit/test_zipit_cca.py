"""ZipIt! and CCA Merge: a permuted copy is undone exactly, CCA's map is the linear mix it
should be, ``epsilon="auto"`` chooses on the fusion-set loss, ZipIt! is FS-Merge's ZipIt start
folded untrained, and blocks are refused before any site trains."""

from __future__ import annotations

import pytest
import torch

from fedfuse.fusion import CCAMerge, FSMerge, FusionInputs, ZipIt
from fedfuse.fusion.blocks.selection import best_on_fusion_set, preferred_first
from fedfuse.fusion.methods.matching.cca_merge import EPSILON_GRID, UNLABELLED, canonical_map
from fedfuse.fusion.methods.trained.fs_merge import zipit_assignment
from fedfuse.models import build_model, lenet5_spec, mlp_spec, resnet_spec, vgg11_spec
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import randn

SPECS = {
    "mlp": mlp_spec((1, 3, 3), 3, (7, 6)),
    "lenet": lenet5_spec((1, 28, 28), 10),
    "vgg": vgg11_spec((1, 32, 32), 3, width_multiplier=1 / 8),
}


@pytest.mark.parametrize("method", [ZipIt(), CCAMerge(epsilon=1.0)], ids=["zipit", "cca"])
@pytest.mark.parametrize("arch", ["mlp", "lenet", "vgg"])
def test_a_model_fused_with_its_permuted_copies_keeps_its_function(method, arch):
    spec = SPECS[arch]
    model = build_model(spec, seed=0).eval()
    copies = [
        permute_model(model, random_permutations(model, torch.Generator().manual_seed(s)))
        for s in (1, 2)
    ]
    data = randn(3, 200, *spec.input_shape)  # more rows than any level's neurons
    labels = torch.arange(200) % spec.num_classes
    fused = method.fuse([model, *copies], FusionInputs(data=data, labels=labels)).model
    x = randn(4, 16, *spec.input_shape)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_canonical_map_undoes_an_invertible_linear_mix():
    reference = randn(5, 4000, 6).double() * torch.tensor([3.0, 2.0, 1.0, 1.0, 0.5, 0.2]).double()
    mix = randn(6, 6, 6).double() + 3 * torch.eye(6, dtype=torch.float64)
    other = reference @ torch.linalg.inv(mix) + 1.5  # another basis and another offset
    transform = canonical_map(reference, other, epsilon=1e-9)
    torch.testing.assert_close(transform, mix, rtol=1e-5, atol=1e-5)


def test_auto_epsilon_takes_the_best_fusion_set_accuracy_and_needs_labels_only_to_choose():
    spec = SPECS["mlp"]
    models = [build_model(spec, seed=s).eval() for s in (0, 1)]
    data, labels = randn(7, 60, *spec.input_shape), torch.arange(60) % 3
    method = CCAMerge()
    assert method.needs() == {"data", "labels"} and method.requirements() == {"data"}
    details = method.fuse(models, FusionInputs(data=data, labels=labels)).details
    losses = details["fusion_set_losses"]
    assert sorted(losses) == sorted(str(e) for e in EPSILON_GRID)
    # the unlabelled ridge preferred, kept unless another is significantly more accurate
    order = preferred_first(EPSILON_GRID, UNLABELLED)
    inputs = FusionInputs(data=data, labels=labels)
    candidates = [(e, (CCAMerge(epsilon=e).fuse(models, inputs).model, {})) for e in order]
    assert details["epsilon"] == best_on_fusion_set(candidates, inputs).key
    assert "fusion_set_losses" not in method.fuse(models, FusionInputs(data=data)).details


def test_zipit_is_fs_merges_zipit_start_folded_untrained():
    spec = SPECS["mlp"]
    models = [build_model(spec, seed=s).eval() for s in (0, 1, 2)]
    inputs = FusionInputs(data=randn(8, 50, *spec.input_shape))
    zipped = ZipIt().fuse(models, inputs).model.state_dict()
    untrained = FSMerge(init="zipit", epochs=0, rank=0).fuse(models, inputs).model.state_dict()
    for name, tensor in zipped.items():
        torch.testing.assert_close(tensor, untrained[name])
    assert ZipIt.accepted_options() == ["head", "device", "batch_size_capture"]


@pytest.mark.parametrize("method", [ZipIt(), CCAMerge()])
def test_resnets_are_refused_before_any_site_trains(method):
    with pytest.raises(ValueError, match=f"{method.name}: cannot fuse resnet models"):
        method.check_run(2, resnet_spec((3, 8, 8), 3, depth=10, width_multiplier=0.25))


def test_bad_epsilon_is_named():
    with pytest.raises(ValueError, match="cca-merge: epsilon must be 'auto' or > 0"):
        CCAMerge(epsilon=0)


def _zipit_by_full_argmax(corr: torch.Tensor, models: int, width: int) -> torch.Tensor:
    """The greedy zipping written plainly: one argmax over every valid pair per merge."""
    n = len(corr)
    link, sizes = corr.double().clone(), [1] * n
    alive, labels, cap = [True] * n, list(range(n)), models
    while sum(alive) > width:
        pairs = [
            (link[i, j].item(), -i, -j)
            for i in range(n)
            for j in range(n)
            if i != j and alive[i] and alive[j] and sizes[i] + sizes[j] <= cap
        ]
        if not pairs:
            cap += 1
            continue
        _, i, j = max(pairs)
        i, j = -i, -j
        link[i] = (sizes[i] * link[i] + sizes[j] * link[j]) / (sizes[i] + sizes[j])
        link[:, i] = link[i]
        sizes[i] += sizes[j]
        alive[j] = False
        labels = [i if label == j else label for label in labels]
    roots = sorted(set(labels), key=labels.index)
    return torch.tensor([roots.index(label) for label in labels])


@pytest.mark.parametrize("models, width, ties", [(2, 6, False), (3, 5, True), (4, 4, True)])
def test_the_incremental_zipping_merges_the_pairs_a_full_argmax_would(models, width, ties):
    x = randn(9, 100, models * width)
    x[:, width : 2 * width] += 2 * x[:, :width]
    corr = torch.corrcoef(x.T)
    if ties:
        corr = (corr * 4).round() / 4
    expected = _zipit_by_full_argmax(corr, models, width)
    torch.testing.assert_close(zipit_assignment(corr, models, width), expected)
