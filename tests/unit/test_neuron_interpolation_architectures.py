"""Neuron interpolation on ResNets and ViTs: residual streams, BatchNorm, widths, compression."""

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.blocks import whitening
from fedfuse.fusion.blocks.batchnorm import batchnorm_input_statistics, refold_batchnorm_statistics
from fedfuse.fusion.blocks.whitening import whitener, whitening_cutoff
from fedfuse.models import LeveledModel, build_model, make_spec
from fedfuse.models.symmetry import permute_model, random_permutations

RESNET = make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=1 / 8)
VIT = make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48)
FAST = {"epochs": 3, "last_epochs": 3, "device": "cpu", "use_scores": False}
ON_RESNET_AND_VIT = pytest.mark.parametrize("spec", [RESNET, VIT], ids=["resnet", "vit"])
GRADIENT_METHODS = pytest.mark.parametrize("method", ["hf-gradient", "kf-gradient"])


def _model(spec, seed, generator):
    """A model with non-trivial BatchNorm statistics (train-mode passes on shifted data)."""
    model = build_model(spec, seed=seed)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, *spec.input_shape, generator=generator) * 2 + 0.5)
    return model.eval()


def _model_and_permuted_copy(spec, generator):
    """A model of ``spec`` and a copy with every neuron symmetry randomly permuted."""
    model = _model(spec, 0, generator)
    return model, permute_model(model, random_permutations(model, generator))


@ON_RESNET_AND_VIT
@GRADIENT_METHODS
def test_fusing_a_model_with_its_permuted_copy_keeps_its_function(spec, method, generator):
    model, copy = _model_and_permuted_copy(spec, generator)
    data = torch.randn(128, *spec.input_shape, generator=generator)
    fused = make_fusion_method(method, epsilon=0.0, **FAST).fuse([model, copy], FusionInputs(data))
    expected, got = model(data), fused.model.eval()(data)
    # AdamW moves a zero-loss start a little; a wrong pairing or a scrambled residual stream
    # would move the logits by their own size
    assert (got - expected).abs().max() < 0.2 * expected.abs().max()
    assert (got.argmax(1) == expected.argmax(1)).float().mean() > 0.9
    residual = [level.get("residual", False) for level in fused.details["levels"]]
    assert residual == [fused.model.is_residual(i) for i in fused.model.neuron_levels]


def test_residual_levels_number_clusters_like_the_input_channels(generator):
    method = make_fusion_method("kf-gradient", device="cpu")
    x = torch.randn(200, 6, generator=generator)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    outputs = [x[:, order] + 0.01 * torch.randn(200, 6, generator=generator)]
    labels = method._residual_labels(x, outputs, torch.ones(6), [6], 6)
    # base neuron i is input channel order[i] plus a small residual: it must take that number
    assert torch.equal(labels, order)


def test_refolding_batchnorm_keeps_the_function_and_sets_the_data_statistics(generator):
    model = _model(RESNET, 0, generator)
    data = torch.randn(64, *RESNET.input_shape, generator=generator)
    before = model(data)
    assert refold_batchnorm_statistics(model, data) == 12  # stem, 2 per block, 3 shortcuts
    assert torch.allclose(model(data), before, atol=1e-5)
    for name, (mean, var) in batchnorm_input_statistics(model, data).items():
        norm = dict(model.named_modules())[name]
        assert torch.allclose(norm.running_mean.double(), mean, atol=1e-5), name
        assert torch.allclose(norm.running_var.double(), var, atol=1e-4), name


def test_fused_resnet_has_batchnorm_statistics_of_the_fusion_set(generator):
    models = [_model(RESNET, seed, generator) for seed in (0, 1)]
    data = torch.randn(96, *RESNET.input_shape, generator=generator)
    fused = make_fusion_method("kf-gradient", **FAST).fuse(models, FusionInputs(data)).model
    assert fused.eval() is fused
    for name, (mean, var) in batchnorm_input_statistics(fused, data).items():
        norm = dict(fused.named_modules())[name]
        assert torch.allclose(norm.running_mean.double(), mean, atol=1e-4), name
        assert torch.allclose(norm.running_var.double(), var, atol=1e-3, rtol=1e-3), name


@pytest.mark.parametrize(
    ("specs", "target"),
    [
        (
            [RESNET, make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=1 / 16)],
            RESNET.with_widths((6, 6, 12, 24, 48)),
        ),
        (
            [VIT, make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=16, mlp=48)],
            VIT.with_widths((24, 24, 24)),
        ),
    ],
    ids=["resnet", "vit"],
)
def test_models_of_different_widths_fuse_into_a_chosen_width(specs, target, generator):
    models = [_model(spec, seed, generator) for seed, spec in enumerate(specs)]
    data = torch.randn(64, *target.input_shape, generator=generator)
    fused = make_fusion_method("kf-gradient", **FAST).fuse(
        models, FusionInputs(data), target=target
    )
    assert fused.model.spec == target
    shapes = {k: tuple(v.shape) for k, v in build_model(target, device="meta").state_dict().items()}
    assert {k: tuple(v.shape) for k, v in fused.model.state_dict().items()} == shapes
    out = fused.model.eval()(data)
    assert out.shape == (64, 10) and torch.isfinite(out).all()


def test_compressing_a_deeper_resnet_into_a_shallower_one(generator):
    big = make_spec("resnet", (1, 28, 28), 10, depth=18, width_multiplier=1 / 16)
    small = make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=1 / 16)
    teacher = _model(big, 0, generator)
    data = torch.randn(128, *big.input_shape, generator=generator)
    method = make_fusion_method("kf-gradient", **{**FAST, "epochs": 10, "last_epochs": 10})
    result = method.fuse([teacher], FusionInputs(data), target=small)
    assert result.model.spec == small and result.model.num_levels == 6
    expected = teacher(data)
    fresh = build_model(small, seed=0).eval()(data)
    error = (result.model.eval()(data) - expected).pow(2).mean()
    assert error < 0.5 * (fresh - expected).pow(2).mean()
    with pytest.raises(ValueError, match="cannot compress"):
        make_fusion_method("fedavg").fuse([teacher], FusionInputs(data), target=small)


# ------------------------------------------------------------------ closed form inside blocks
SUBLAYERS = {
    "resnet": [["conv"], ["conv1", "conv2"], ["conv1", "conv2+shortcut"]],
    "vit": [
        ["projection+position"],
        ["q+k", "v+out", "out", "fc1", "fc2"],
        ["q+k", "v+out", "out", "fc1", "fc2"],
    ],
}


@ON_RESNET_AND_VIT
@pytest.mark.parametrize("method", ["hf-linear", "kf-linear"])
def test_closed_form_fusion_of_a_model_with_its_permuted_copy_keeps_its_function(
    spec, method, generator
):
    model, copy = _model_and_permuted_copy(spec, generator)
    data = torch.randn(96, *spec.input_shape, generator=generator)
    fused = make_fusion_method(method, use_scores=False).fuse([model, copy], FusionInputs(data))
    fresh = torch.randn(48, *spec.input_shape, generator=generator)
    expected, got = model(fresh), fused.model.eval()(fresh)
    # every sub-layer fit is exact here: only float32 rounding and the ridge's shrinkage remain
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max()
    sublayers = [level.get("sublayers") for level in fused.details["levels"]]
    assert [list(s) for s in sublayers[:3]] == SUBLAYERS[spec.arch] and sublayers[-1] is None


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_a_fused_vit_has_balanced_attention_factors(method, generator):
    """The closed form fits the products of queries and keys, of values and outputs; their
    factors come back with equal norms per channel (on trained ViTs they differed by 10^4, and
    one epoch of fine-tuning then broke the fused model)."""
    models = [_model(VIT, seed, generator) for seed in range(2)]
    data = torch.randn(96, *VIT.input_shape, generator=generator)
    fused = make_fusion_method(method, use_scores=False).fuse(models, FusionInputs(data)).model

    def norms(layer):
        return (layer.weight.pow(2).sum(1) + layer.bias.pow(2)).sqrt()

    for block in fused.levels[1:-1]:
        attention = block.attention
        torch.testing.assert_close(norms(attention.q), norms(attention.k))
        torch.testing.assert_close(norms(attention.v), attention.out.weight.norm(dim=0))


def test_the_whitening_cut_drops_the_directions_the_data_barely_excites(generator):
    basis = torch.linalg.qr(torch.randn(5, 5, generator=generator, dtype=torch.float64))[0]
    values = torch.tensor([1e-7, 1e-4, 1.0, 2.0, 3.0], dtype=torch.float64)
    gram = basis @ torch.diag(values) @ basis.T
    assert whitener(gram)[0].shape[1] == 5  # the default keeps them (1e-8 of the mean)
    with whitening_cutoff(1e-3):
        half, inverse = whitener(gram)
    assert half.shape[1] == 3 and whitener(gram)[0].shape[1] == 5  # the block ends the cut
    kept = basis[:, 2:]
    torch.testing.assert_close(half @ half.T, kept @ torch.diag(values[2:]) @ kept.T)
    torch.testing.assert_close(inverse.T @ half, torch.eye(3, dtype=torch.float64))


def test_a_vit_fused_with_the_whitening_cut_keeps_the_function_of_a_permuted_copy(generator):
    model, copy = _model_and_permuted_copy(VIT, generator)
    data = torch.randn(96, *VIT.input_shape, generator=generator)
    method = make_fusion_method("kf-linear", use_scores=False, whiten_rcond=1e-3)
    fused = method.fuse([model, copy], FusionInputs(data)).model.eval()
    expected = model(data)
    assert (fused(data) - expected).abs().max() < 1e-3 * expected.abs().max()
    with pytest.raises(ValueError, match="whiten_rcond"):
        make_fusion_method("kf-sites", whiten_rcond=2.0)


@pytest.mark.parametrize("name", ["kf-linear", "kf-trust"])
def test_a_methods_whitening_cut_reaches_every_attention_fit_and_ends_with_it(
    name, generator, monkeypatch
):
    """Both families that fit the pieces (fusion-set and site-statistics fits) whiten with the
    method's own ``whiten_rcond`` during its fusion, and with the default after it."""
    cuts = []
    spectrum = whitening.gram_spectrum

    def recording(gram, *, rows, rcond):
        cuts.append(rcond)
        return spectrum(gram, rows=rows, rcond=rcond)

    monkeypatch.setattr(whitening, "gram_spectrum", recording)
    models = [_model(VIT, seed, generator) for seed in (0, 1)]
    data = torch.randn(48, *VIT.input_shape, generator=generator)
    labels = torch.arange(48) % VIT.num_classes
    method = make_fusion_method(name, use_scores=False, whiten_rcond=1e-3)
    method.fuse(models, FusionInputs(data, labels=labels))
    assert cuts and set(cuts) == {1e-3}
    cuts.clear()
    whitening.whitener(torch.eye(3, dtype=torch.float64))
    assert cuts == [whitening.WHITEN_RCOND]


def test_attention_heads_are_matched_across_models_by_their_maps(generator):
    """A copy whose heads are reordered (queries, keys, values and the output's columns moved
    together) pairs each head with its own image, so the fit stays exact."""
    model, copy = _model_and_permuted_copy(VIT, generator)
    order = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        for block in copy.levels[1:-1]:
            size = block.attention.q.out_features // 4
            index = (order[:, None] * size + torch.arange(size)).flatten()
            for name in ("q", "k", "v"):
                layer = getattr(block.attention, name)
                layer.weight.copy_(layer.weight[index])
                layer.bias.copy_(layer.bias[index])
            block.attention.out.weight.copy_(block.attention.out.weight[:, index])
    data = torch.randn(96, *VIT.input_shape, generator=generator)
    torch.testing.assert_close(copy(data), model(data), atol=1e-4, rtol=1e-4)
    fused = make_fusion_method("hf-linear", use_scores=False).fuse(
        [model, copy], FusionInputs(data)
    )
    heads = fused.details["levels"][1]["heads"]
    assert heads[4:] == [heads[:4][i] for i in order.tolist()]
    expected = model(data)
    assert (fused.model.eval()(data) - expected).abs().max() < 1e-3 * expected.abs().max()


def test_k_means_linear_fuses_three_resnets_into_a_narrower_one(generator):
    models = [_model(RESNET, seed, generator) for seed in range(3)]
    data = torch.randn(64, *RESNET.input_shape, generator=generator)
    target = RESNET.with_widths([w // 2 for w in RESNET.widths])
    fused = make_fusion_method("kf-linear", use_scores=False).fuse(
        models, FusionInputs(data), target=target
    )
    assert fused.model.spec == target
    assert torch.isfinite(fused.model.eval()(data)).all()
    assert fused.details["batchnorm_refolded"] == 12


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_closed_form_variants_accept_resnets_and_vits_and_name_a_level_they_cannot_fit(method):
    make_fusion_method(method).check_run(2, RESNET)
    make_fusion_method(method).check_run(2, VIT)
    spec = make_spec("mlp", (4,), 3, widths=[8])
    two_layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
    model = LeveledModel([two_layers, nn.Linear(8, 3)], spec)
    with pytest.raises(ValueError, match=r"level 0:Linear\+ReLU\+Linear is neither affine"):
        make_fusion_method(method).check_architecture(model)


@ON_RESNET_AND_VIT
@GRADIENT_METHODS
def test_a_closed_form_start_is_kept_when_descent_cannot_improve_it(spec, method, generator):
    model, copy = _model_and_permuted_copy(spec, generator)
    data = torch.randn(96, *spec.input_shape, generator=generator)
    fused = make_fusion_method(
        method, use_scores=False, start="closed-form", preset="refine", device="cpu"
    ).fuse([model, copy], FusionInputs(data))
    fresh = torch.randn(48, *spec.input_shape, generator=generator)
    expected = model(fresh)
    # Table 9's start moves the logits by a fifth of their size on this very case (above)
    assert (fused.model.eval()(fresh) - expected).abs().max() < 1e-2 * expected.abs().max()
    levels = fused.details["levels"]
    assert all(level["closed_form_cost"] < 1e-6 for level in levels)
    assert fused.details["gradient"]["patience"] == 3
    with pytest.raises(ValueError, match="start must be one of"):
        make_fusion_method(method, start="somewhere")
