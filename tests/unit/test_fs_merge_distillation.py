"""FS-Merge (folding, initialisations, training) and the fusion-set references KD and LP."""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.methods.trained.distillation import KnowledgeDistillation, LinearProbe
from fedfuse.fusion.methods.trained.fs_merge import (
    FoldableMatrix,
    FoldableSuperNet,
    FSMerge,
    StackedLevel,
    correlation_matrix,
    on_channels,
    zipit_assignment,
)
from fedfuse.fusion.methods.trained.teaching import distillation_loss, ensemble_log_probs
from fedfuse.fusion.registry import FUSION_METHODS, make_fusion_method
from fedfuse.models import LeveledModel, build_model, mlp_spec, vgg11_spec

SPEC = mlp_spec((1, 4, 4), 3, (8, 6))


def _data(n: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def pair() -> list[LeveledModel]:
    return [build_model(SPEC, seed=0).eval(), build_model(SPEC, seed=1).eval()]


@pytest.fixture
def fusion() -> FusionInputs:
    x = _data(120, (1, 4, 4))
    return FusionInputs(data=x, labels=torch.arange(len(x)) % 3)


def _kl(models: list[LeveledModel], student: torch.nn.Module, x: torch.Tensor) -> float:
    teacher = ensemble_log_probs(models, x, device="cpu")
    with torch.no_grad():
        return float(distillation_loss(student(x), teacher, 1.0))


def test_methods_are_registered_and_configurable():
    for name in ("fs-merge", "kd", "linear-probe"):
        assert name in FUSION_METHODS
    method = make_fusion_method("fs-merge", objective="local", init="first", rank=0, epochs=3)
    assert isinstance(method, FSMerge) and method.schedule().epochs == 3
    fast = FSMerge().schedule()  # the default recipe: Adam, 300 epochs, one cosine cycle
    assert (fast.optimizer, fast.epochs, fast.lr, fast.scheduler) == ("adam", 300, 0.01, "cosine")
    paper = FSMerge(recipe="paper").schedule()  # App. E.1: global, ZipIt init
    assert (paper.optimizer, paper.epochs, paper.lr, paper.momentum) == ("sgd", 10_000, 0.1, 0.9)
    assert FSMerge(recipe="paper", objective="local").schedule().scheduler == "step"
    overridden = FSMerge(recipe="paper", optimizer="adam", lr=0.5, epochs=7).schedule()
    assert (overridden.optimizer, overridden.lr, overridden.epochs) == ("adam", 0.5, 7)
    with pytest.raises(ValueError, match="recipe"):
        FSMerge(recipe="slow")
    with pytest.raises(ValueError):
        make_fusion_method("fs-merge", init="random")


@pytest.mark.parametrize("rank", [0, 4, -1])
@pytest.mark.parametrize("kind", ["merge", "unmerge"])
def test_foldable_matrix_applies_what_it_folds(rank, kind):
    g = torch.Generator().manual_seed(0)
    width, models = 5, 3
    assignments = {
        "identity": torch.arange(width).repeat(models),
        "regular": torch.randperm(width * models, generator=g) % width,
        "general": torch.tensor([0, 0, 0, 0, 1, 2, 3, 4, 4, 4, 1, 2, 3, 1, 2]),
    }
    for layout, assign in assignments.items():
        matrix = FoldableMatrix(kind, assign, torch.randn(len(assign), generator=g), width, rank, g)
        assert matrix.layout == layout
        if matrix.right is not None:
            with torch.no_grad():
                matrix.right.normal_(generator=g)  # make the low-rank part non-zero
        x = torch.randn(7, matrix.shape[1], generator=g)
        assert torch.allclose(matrix(x), x @ matrix.dense().T, atol=1e-5)


def test_zipit_pairs_each_neuron_with_its_permuted_twin():
    features = _data(200, (6,))
    permutation = torch.tensor([3, 0, 5, 1, 4, 2])
    twin = features[:, permutation] * 2.0 + 0.01 * _data(200, (6,), seed=1)
    assign = zipit_assignment(correlation_matrix([features, twin]), 2, 6)
    assert torch.equal(assign[6:], assign[:6][permutation])
    assert torch.equal(torch.bincount(assign), torch.full((6,), 2))


@pytest.mark.parametrize("objective", ["local", "global"])
def test_first_init_folds_back_to_model_zero_exactly(pair, fusion, objective):
    method = FSMerge(objective=objective, init="first", head="first", epochs=0)
    result = method.fuse(pair, fusion)
    x = _data(40, (1, 4, 4), seed=3)
    assert torch.equal(result.model(x), pair[0](x))
    assert result.model.spec == SPEC
    assert result.details["kind"] == "fusion"


def test_first_init_folds_back_exactly_on_a_cnn():
    spec = vgg11_spec((3, 16, 16), 10, width_multiplier=1 / 16)
    models = [build_model(spec, seed=0).eval(), build_model(spec, seed=1).eval()]
    x = _data(8, (3, 16, 16))
    method = FSMerge(objective="local", init="first", head="first", epochs=0)
    fused = method.fuse(models, FusionInputs(data=x)).model
    assert torch.equal(fused(x), models[0](x))


def test_average_init_of_identical_models_folds_to_that_model(pair, fusion):
    twins = [pair[0], copy.deepcopy(pair[0])]
    for head in ("mean", "first"):
        fused = FSMerge(init="average", head=head, epochs=0).fuse(twins, fusion).model
        x = _data(40, (1, 4, 4), seed=3)
        assert torch.allclose(fused(x), pair[0](x), atol=1e-6)


def test_zipit_init_of_a_model_and_its_twin_folds_to_that_model(pair, fusion):
    twins = [pair[0], copy.deepcopy(pair[0])]
    fused = FSMerge(objective="local", init="zipit", epochs=0).fuse(twins, fusion).model
    x = _data(40, (1, 4, 4), seed=3)
    assert torch.allclose(fused(x), pair[0](x), atol=1e-5)


@pytest.mark.parametrize(
    ("objective", "init", "rank"),
    [
        ("local", "first", 4),
        ("global", "zipit", 4),
        ("global", "average", -1),
        ("local", "zipit", 0),
    ],
)
def test_training_lowers_the_loss_and_keeps_the_spec(pair, fusion, objective, init, rank):
    method = FSMerge(objective=objective, init=init, rank=rank, epochs=60, seed=1)
    result = method.fuse(pair, fusion)
    details = result.details
    assert details["loss"]["final"] < details["loss"]["initial"]
    assert result.model.spec == SPEC
    assert [p.shape for p in result.model.parameters()] == [p.shape for p in pair[0].parameters()]
    assert details["train_seconds"] >= 0 and details["learnable_parameters"] > 0
    curves = [details["training"]] if objective == "global" else details["levels"]
    assert all(c["curve"][0][0] == 0 and c["curve"][-1][0] == 60 for c in curves)
    # the folded model computes what the SuperNet computed: its features before the head are
    # the merged features, so re-running is deterministic
    again = FSMerge(objective=objective, init=init, rank=rank, epochs=60, seed=1).fuse(pair, fusion)
    assert torch.equal(again.model(fusion.data), result.model(fusion.data))


@pytest.mark.parametrize("spec", [SPEC, vgg11_spec((3, 8, 8), 4, width_multiplier=1 / 32)])
@pytest.mark.parametrize("rank", [2, -1])
def test_the_folded_model_computes_what_the_supernet_computes(spec, rank):
    """Eq. 5: the fused logits are model 0's head on its slot of the SuperNet's reconstruction."""
    models = [build_model(spec, seed=s).eval() for s in range(3)]
    g = torch.Generator().manual_seed(0)
    levels = models[0].neuron_levels
    merges, unmerges = [], []
    for index in levels[:-1]:
        width = models[0].level_width(index)
        assign = torch.randperm(3 * width, generator=g) % width
        for kind, store in (("merge", merges), ("unmerge", unmerges)):
            matrix = FoldableMatrix(
                kind, assign, torch.rand(3 * width, generator=g), width, rank, g
            )
            with torch.no_grad():
                for parameter in matrix.parameters():
                    parameter.add_(0.1 * torch.randn(parameter.shape, generator=g))
            store.append(matrix)
    between = [
        torch.nn.Sequential(*models[0].levels[a + 1 : b])
        for a, b in zip(levels[:-1], levels[1:], strict=True)
    ]
    net = FoldableSuperNet(merges, unmerges, between)
    x = _data(5, spec.input_shape)
    with torch.no_grad():
        first = torch.cat([m.levels[levels[0]](x) for m in models], 1)
        base_levels = [StackedLevel([m.levels[i] for m in models]) for i in levels[1:-1]]
        reconstruction = net.chain(first, base_levels)
        slot = reconstruction[:, : models[0].level_width(levels[-2])]
        expected = models[0].levels[levels[-1]](slot)
        fused = FSMerge(head="first").fold(models, merges, unmerges)
        assert torch.allclose(fused(x), expected, atol=1e-4)
        mean = FSMerge(head="mean").fold(models, merges, unmerges)
        parts = reconstruction.split(slot.shape[1], dim=1)
        logits = torch.stack([m.levels[levels[-1]](p) for m, p in zip(models, parts, strict=True)])
        assert torch.allclose(mean(x), logits.mean(0), atol=1e-4)


def test_fs_merge_leaves_the_base_models_untouched(pair, fusion):
    before = [copy.deepcopy(m.state_dict()) for m in pair]
    FSMerge(objective="global", init="zipit", epochs=5).fuse(pair, fusion)
    for model, state in zip(pair, before, strict=True):
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_distillation_loss_is_zero_for_the_same_distribution_and_positive_otherwise(pair):
    x = _data(30, (1, 4, 4))
    teacher = ensemble_log_probs([pair[0]], x, device="cpu")  # a single-model teacher
    with torch.no_grad():
        same = distillation_loss(pair[0](x), teacher, 4.0)
        other = distillation_loss(pair[1](x), teacher, 4.0)
    assert abs(float(same)) < 1e-6
    assert float(other) > 1e-4
    # T^2 * KL(p_t || p_s) with the softened distributions, averaged over the batch
    p_t = torch.softmax(teacher / 4, -1)
    manual = 16 * (p_t * (p_t.log() - torch.log_softmax(pair[1](x).detach() / 4, -1))).sum(1)
    assert torch.allclose(other, manual.mean(), atol=1e-6)


def test_kd_moves_the_student_toward_the_ensemble(pair, fusion):
    result = KnowledgeDistillation(epochs=15, val_split=0.0, lr=3e-3).fuse(pair, fusion)
    before, after = result.details["before"], result.details["after"]
    assert after["kl_to_ensemble"] < before["kl_to_ensemble"]
    assert _kl(pair, result.model, fusion.data) < _kl(pair, pair[0], fusion.data)
    assert result.details["kind"] == "trains on the fusion set"
    assert result.model.spec == SPEC


@pytest.mark.parametrize("student_init", ["fresh", "average"])
def test_kd_other_students_and_label_mixing(pair, fusion, student_init):
    method = KnowledgeDistillation(student_init, ce_weight=0.5, epochs=3, val_split=0.2)
    result = method.fuse(pair, fusion)
    assert result.details["training"]["validation_samples"] == 24
    assert result.details["after"]["kd_loss"] >= 0
    with pytest.raises(ValueError, match="labels"):
        method.fuse(pair, FusionInputs(data=fusion.data))


def test_linear_probe_changes_only_the_head(pair, fusion):
    result = LinearProbe(epochs=20, val_split=0.0, lr=1e-2).fuse(pair, fusion)
    probe, base = result.model, pair[0]
    head = base.neuron_levels[-1]
    for index, (mine, theirs) in enumerate(zip(probe.levels, base.levels, strict=True)):
        same = all(
            torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters(), strict=True)
        )
        assert same == (index != head), index
    assert result.details["after"]["kl_to_ensemble"] < result.details["before"]["kl_to_ensemble"]
    assert result.details["kind"] == "trains on the fusion set"


def test_linear_probe_on_labels_fits_them(pair, fusion):
    result = LinearProbe("labels", body=1, epochs=30, val_split=0.0, lr=3e-2).fuse(pair, fusion)
    assert result.details["after"]["accuracy"] > result.details["before"]["accuracy"]
    assert result.details["training"]["best_loss"] < result.details["training"]["initial_loss"]
    with pytest.raises(ValueError, match="labels"):
        LinearProbe("labels").fuse(pair, FusionInputs(data=fusion.data))


@pytest.mark.parametrize(
    ("make", "part_shape", "kind"),
    [
        (lambda: torch.nn.Conv2d(3, 4, 3, padding=1), (3, 6, 6), "conv"),
        (lambda: torch.nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False), (4, 6, 6), "conv"),
        (lambda: torch.nn.Linear(5, 7), (5,), "linear"),
        (
            lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3, bias=False)),
            (3, 2, 2),
            "flatten-linear",
        ),
        (lambda: torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Conv2d(3, 2, 1)), (3, 4, 4), "loop"),
    ],
)
def test_a_stacked_level_computes_each_models_level_on_its_slice(make, part_shape, kind) -> None:
    """One grouped/batched call gives exactly the model-by-model outputs, concatenated."""
    torch.manual_seed(0)
    levels = [make() for _ in range(3)]
    parts = [torch.randn(4, *part_shape) for _ in levels]
    stacked = StackedLevel(levels)
    expected = torch.cat([level(p) for level, p in zip(levels, parts, strict=True)], 1)
    assert stacked.kind == kind
    assert torch.allclose(stacked(torch.cat(parts, 1)), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: torch.nn.Conv2d(2, 4, 3, padding=1), (2, 6, 6)),
        (lambda: torch.nn.Linear(5, 4, bias=False), (5,)),
        (lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4)), (3, 2, 2)),
    ],
)
def test_a_merge_folded_into_the_first_level_equals_merging_its_outputs(make, shape) -> None:
    """``M (W x + b)`` computed as one level on ``x`` equals the merge of the K outputs."""
    torch.manual_seed(0)
    levels = [make() for _ in range(3)]
    g = torch.Generator().manual_seed(1)
    merge = FoldableMatrix("merge", torch.arange(4).repeat(3), torch.rand(12, generator=g), 4, 2, g)
    with torch.no_grad():
        merge.right.add_(torch.randn(merge.right.shape, generator=g))
    x = torch.randn(5, *shape)
    stacked = StackedLevel(levels)
    assert stacked.folds_a_merge
    expected = on_channels(merge, torch.cat([level(x) for level in levels], 1))
    assert torch.allclose(stacked.merged(merge, x), expected, atol=1e-5)
    grouped = StackedLevel([torch.nn.Conv2d(2, 4, 1, groups=2) for _ in range(3)])
    assert not grouped.folds_a_merge
    with pytest.raises(ValueError, match="cannot fold"):
        grouped.merged(merge, torch.randn(1, 2, 3, 3))
