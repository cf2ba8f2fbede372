"""RegMean, KD, the linear probe and the ensemble on ResNet and ViT; FedMA refuses them before any
site trains."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedfuse.fusion.base import FusionInputs
from fedfuse.fusion.blocks.space_alignment import align_model
from fedfuse.fusion.methods.regression.regmean import RegMean, level_grams, module_grams_layout
from fedfuse.fusion.registry import make_fusion_method
from fedfuse.fusion.statistics.grams import align_grams
from fedfuse.io.checkpoint import load_checkpoint, save_checkpoint
from fedfuse.io.validation import validate_grams
from fedfuse.models import LeveledModel, ModelSpec, build_model, make_spec
from fedfuse.models.ensemble import Ensemble
from fedfuse.models.symmetry import (
    feature_spaces,
    permutation_matrix,
    permute_model,
    random_permutations,
)

SPECS = {
    "resnet": make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=0.125),
    "vit": make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def _perturbed(model: LeveledModel, seed: int) -> LeveledModel:
    """A copy with every float state entry moved (BatchNorm statistics included)."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for value in other.state_dict().values():
            if value.is_floating_point():
                noise = torch.randn(value.shape, generator=generator)
                value.add_(0.1 * noise * (value.abs().mean() + 0.1))
                if value.dim() == 1 and value.min() > 0:  # running_var stays positive
                    value.abs_()
    return other


def _inputs_of(model: LeveledModel, level: int, name: str, x: torch.Tensor) -> torch.Tensor:
    """The input tensor module ``name`` of level ``level`` receives on ``x`` (eval mode)."""
    module = dict(model.levels[level].named_modules())[name]
    seen = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    model.eval()
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


# ------------------------------------------------------------------------------- regmean
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_regmean_of_a_model_with_itself_is_the_model(arch):
    model = build_model(SPECS[arch], seed=0)
    x = _data(12)
    grams = level_grams(model, x)
    assert sorted(grams) == model.neuron_levels
    result = RegMean().fuse([model, copy.deepcopy(model)], FusionInputs(grams=[grams, grams]))
    model.eval()
    assert result.model.spec == model.spec
    torch.testing.assert_close(result.model(x), model(x), atol=1e-5, rtol=1e-4)


ALIGN_SPECS = {**SPECS, "mlp": make_spec("mlp", (1, 28, 28), 10, widths=[24, 16])}


@pytest.mark.parametrize("arch", sorted(ALIGN_SPECS))
def test_a_sites_grams_permuted_by_the_server_are_its_permuted_models_grams(arch):
    # what align="activations" relies on: no site data needed to re-express an upload
    model = build_model(ALIGN_SPECS[arch], seed=0)
    maps = {
        name: permutation_matrix(p)
        for name, p in random_permutations(model, torch.Generator().manual_seed(1)).items()
    }
    spaces = feature_spaces(model)
    x = _data(30)
    expected = level_grams(align_model(model, maps, spaces), x)
    permuted = align_grams(model, level_grams(model, x), spaces, maps)
    assert sorted(permuted) == sorted(expected)
    for level, gram in expected.items():
        torch.testing.assert_close(permuted[level], gram, rtol=1e-5, atol=1e-5)  # float32 sums
    assert any(not torch.equal(level_grams(model, x)[k], g) for k, g in expected.items())


@pytest.mark.parametrize("arch", sorted(ALIGN_SPECS))
def test_aligned_regmean_fuses_a_permuted_copy_back_to_the_model(arch):
    model = build_model(ALIGN_SPECS[arch], seed=0).eval()
    torch.manual_seed(0)
    permutations = random_permutations(model, torch.Generator().manual_seed(2))
    copy_ = permute_model(model, permutations).eval()
    x, fusion_set = _data(40, seed=3), _data(64, seed=4)
    inputs = FusionInputs(data=fusion_set, grams=[level_grams(model, x), level_grams(copy_, x)])
    aligned = RegMean(align="activations").fuse([model, copy_], inputs)
    with torch.no_grad():
        torch.testing.assert_close(aligned.model(x), model(x), atol=1e-4, rtol=1e-4)
        assert aligned.details["align"]["moved"] > 0
        plain = RegMean().fuse([model, copy_], inputs).model  # neuron i with neuron i
        assert (plain(x) - model(x)).abs().max() > 1e-2


def test_aligned_regmean_says_what_it_needs_before_any_site_trains():
    with pytest.raises(ValueError, match="grams='sums' never shows"):
        RegMean(align="activations", grams="sums")
    with pytest.raises(ValueError, match="align must be"):
        RegMean(align="weights")
    assert "data" in RegMean(align="activations").requirements()
    assert "data" not in RegMean().requirements()


def test_aligned_regmean_names_the_site_and_level_of_a_gram_of_the_wrong_size():
    model = build_model(SPECS["vit"], seed=0)
    x = _data(16)
    broken = level_grams(model, x)
    level = model.neuron_levels[1]
    broken[level] = broken[level][:-3, :-3]
    inputs = FusionInputs(data=x, grams=[level_grams(model, x), broken])
    with pytest.raises(ValueError, match=rf"Grams of site 1: the Gram of level .*{level}"):
        RegMean(align="activations").fuse([model, copy.deepcopy(model)], inputs)


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_regmean_grams_travel_like_level_grams(arch, tmp_path):
    """Non-affine levels pack their modules' Grams block-diagonally under the level's key, so
    the sites' validation and the checkpoint format take them unchanged."""
    model = build_model(SPECS[arch], seed=0)
    grams = level_grams(model, _data(8))
    checked = validate_grams(model, grams, source="test")
    layout = module_grams_layout(model)
    for level, blocks in layout.items():
        assert checked[level].shape[0] == sum(block.size for block in blocks)
    if arch == "resnet":
        return  # checkpoint.py does not store BatchNorm's integer batch counters yet
    save_checkpoint(tmp_path / "site.safetensors", model, grams=grams)
    loaded = load_checkpoint(tmp_path / "site.safetensors", with_grams=True)
    assert loaded.grams is not None
    for level, gram in grams.items():
        torch.testing.assert_close(loaded.grams[level], gram)


def test_vit_attention_projections_share_one_gram():
    model = build_model(SPECS["vit"], seed=0)
    blocks = module_grams_layout(model)[1]
    assert blocks[0].modules == ("attention.q", "attention.k", "attention.v")
    assert [b.modules for b in blocks[1:]] == [("attention.out",), ("fc1",), ("fc2",)]


def _closed_form(grams: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    total = sum(grams)
    return torch.linalg.solve(total, sum(g @ w for g, w in zip(grams, weights, strict=True)))


def _regmean_of_two(spec: ModelSpec, samples: int):
    """Two different models of ``spec``, their data, and RegMean's fusion of them."""
    first = build_model(spec, seed=0)
    second = _perturbed(build_model(spec, seed=1), seed=5)
    data = [_data(samples, seed=1), _data(samples, seed=2)]
    grams = [level_grams(m, x) for m, x in zip((first, second), data, strict=True)]
    fused = RegMean(alpha=1.0, jitter=0.0).fuse([first, second], FusionInputs(grams=grams)).model
    return first, second, data, fused


def test_regmean_merges_a_vit_linear_by_its_own_input_gram():
    first, second, data, fused = _regmean_of_two(SPECS["vit"], samples=16)
    by_hand_grams, by_hand_weights = [], []
    for model, x in zip((first, second), data, strict=True):
        rows = _inputs_of(model, 2, "fc1", x).reshape(-1, 32).double()
        rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
        by_hand_grams.append(rows.T @ rows)
        fc1 = model.levels[2].fc1
        by_hand_weights.append(torch.cat([fc1.weight, fc1.bias[:, None]], 1).T.double())
    expected = _closed_form(by_hand_grams, by_hand_weights)
    fc1 = fused.levels[2].fc1
    torch.testing.assert_close(fc1.weight.double(), expected[:-1].T, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(fc1.bias.double(), expected[-1], atol=1e-4, rtol=1e-3)
    # LayerNorms, class token and position embedding are averaged
    for key in ("levels.2.ln1.weight", "levels.0.class_token", "levels.0.position"):
        mean = (first.state_dict()[key] + second.state_dict()[key]) / 2
        torch.testing.assert_close(fused.state_dict()[key], mean)


def test_regmean_merges_a_resnet_conv_by_its_unfolded_input_gram():
    first, second, data, fused = _regmean_of_two(SPECS["resnet"], samples=6)
    by_hand_grams, by_hand_weights = [], []
    for model, x in zip((first, second), data, strict=True):
        inputs = _inputs_of(model, 3, "conv2", x)  # bias-free 3x3 conv, padding 1
        rows = F.unfold(inputs, 3, padding=1).transpose(1, 2).reshape(-1, inputs.shape[1] * 9)
        rows = rows.double()
        by_hand_grams.append(rows.T @ rows)
        by_hand_weights.append(model.levels[3].conv2.weight.flatten(1).T.double())
    expected = _closed_form(by_hand_grams, by_hand_weights)
    conv2 = fused.levels[3].conv2
    torch.testing.assert_close(conv2.weight.flatten(1).double(), expected.T, atol=1e-4, rtol=1e-3)
    for key in ("levels.3.bn2.running_mean", "levels.3.bn1.weight", "levels.0.bn.running_var"):
        mean = (first.state_dict()[key] + second.state_dict()[key]) / 2
        torch.testing.assert_close(fused.state_dict()[key], mean)


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_regmean_accepts_residual_architectures_before_training(arch):
    make_fusion_method("regmean").check_run(3, SPECS[arch], available={"grams"})


def test_regmean_rejects_grams_of_the_wrong_packing():
    model = build_model(SPECS["vit"], seed=0)
    grams = level_grams(model, _data(4))
    grams[1] = grams[1][:-1, :-1]
    with pytest.raises(ValueError, match="regmean: .*grams\\[0\\]\\[1\\]"):
        RegMean().fuse([model, copy.deepcopy(model)], FusionInputs(grams=[grams, grams]))


# ------------------------------------------------------------------ refusals before training
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_fedma_refuses_residual_nets(arch):
    with pytest.raises(ValueError) as caught:
        make_fusion_method("fedma").check_run(2, SPECS[arch])
    message = str(caught.value)
    assert message.startswith(f"fedma: cannot fuse {arch} models")
    assert "kf-gradient, git-rebasin or otfusion" in message and "residual blocks" in message


@pytest.mark.parametrize("method", ["kf-sites", "hf-sites"])
def test_site_statistics_methods_take_resnets_and_vits_and_name_a_level_they_cannot_fit(method):
    make_fusion_method(method).check_run(2, SPECS["resnet"])
    make_fusion_method(method).check_run(2, SPECS["vit"])
    spec = make_spec("mlp", (4,), 3, widths=[8])
    two_layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    model = LeveledModel([two_layers, torch.nn.Linear(8, 3)], spec)
    with pytest.raises(ValueError, match=r"level 0:Linear\+ReLU\+Linear is none of these"):
        make_fusion_method(method).check_architecture(model)


# ------------------------------------------------------------------ KD, probe, ensemble
def _fast(**options):
    return {"epochs": 15, "batch_size": 16, "val_split": 0.0, "patience": 0, "lr": 3e-3,
            "device": "cpu", **options}  # fmt: skip


def _kl_to_teacher(models: list[LeveledModel], student: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        teacher = Ensemble(models).eval()(x)
        student.eval()
        return float(F.kl_div(student(x).log_softmax(-1), teacher, log_target=True,
                              reduction="batchmean"))  # fmt: skip


def test_kd_distils_a_resnet_into_one_of_another_depth():
    spec = SPECS["resnet"]
    models = [build_model(spec, seed=s) for s in (0, 1)]
    target = make_spec("resnet", (1, 28, 28), 10, blocks=(2, 1, 1, 1), width_multiplier=0.0625)
    assert target.options["blocks"] != spec.options["blocks"]
    x = _data(48)
    kd = make_fusion_method("kd", student_init="fresh", temperature=1.0, **_fast())
    result = kd.fuse(models, FusionInputs(data=x), target=target)
    assert result.model.spec == target
    assert result.model.num_levels == build_model(target, device="meta").num_levels
    assert result.model(x[:5]).shape == (5, 10)
    assert _kl_to_teacher(models, result.model, x) < _kl_to_teacher(
        models, build_model(target, seed=0), x
    )
    assert result.details["after"]["kl_to_ensemble"] < result.details["before"]["kl_to_ensemble"]


def test_kd_distils_a_vit_into_a_shallower_narrower_vit():
    models = [build_model(SPECS["vit"], seed=s) for s in (0, 1)]
    target = make_spec("vit", (1, 28, 28), 10, patch=7, depth=1, heads=2, hidden=16, mlp=24)
    x = _data(32)
    kd = make_fusion_method("kd", student_init="fresh", temperature=1.0, **_fast())
    result = kd.fuse(models, FusionInputs(data=x), target=target)
    assert result.model.spec == target
    assert result.model(x[:3]).shape == (3, 10)
    assert result.details["after"]["kl_to_ensemble"] < result.details["before"]["kl_to_ensemble"]


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_linear_probe_refits_only_the_head(arch):
    models = [build_model(SPECS[arch], seed=s) for s in (0, 1)]
    x = _data(32)
    labels = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(0))
    probe = make_fusion_method("linear-probe", **_fast())
    result = probe.fuse(models, FusionInputs(data=x, labels=labels))
    head = models[0].neuron_levels[-1]
    before, after = models[0].state_dict(), result.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(f"levels.{head}.") for k in changed)
    assert result.details["after"]["kl_to_ensemble"] < result.details["before"]["kl_to_ensemble"]


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_ensemble_averages_residual_nets(arch):
    models = [build_model(SPECS[arch], seed=s).eval() for s in (0, 1)]
    x = _data(5)
    out = Ensemble(models).eval()(x)
    assert out.shape == (5, 10)
    with torch.no_grad():
        expected = torch.stack([m(x).softmax(-1) for m in models]).mean(0).log()
    torch.testing.assert_close(out.detach(), expected, atol=1e-5, rtol=1e-5)
