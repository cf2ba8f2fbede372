"""Git Re-Basin, OTFusion and the averages on residual networks (ResNet with BatchNorm, ViT),
driven by the models' feature spaces."""

import copy

import pytest
import torch
from torch import nn

from fedfuse.fusion import make_fusion_method
from fedfuse.fusion.blocks.batchnorm import reset_batchnorm_statistics
from fedfuse.fusion.blocks.space_alignment import block_assignment, block_transport
from fedfuse.fusion.inputs import FusionInputs
from fedfuse.models import build_model, make_spec
from fedfuse.models.affine import output_rows
from fedfuse.models.capture import capture_modules
from fedfuse.models.symmetry import permute_model, random_permutations

SPECS = {
    "resnet": make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=0.125),
    "vit": make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48),
}
ALIGNING = ["git-rebasin", "otfusion"]


def _model(arch, seed, generator):
    """A model whose BatchNorm layers (if any) hold non-trivial running statistics, and whose
    channels all pass ReLU somewhere on :func:`_data`: a channel zero on every sample has no
    activations to be matched by, so its place in a permuted copy would be a tie (which the
    CPU's rounding then breaks either way)."""
    spec = SPECS[arch]
    model = build_model(spec, seed=seed)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, *spec.input_shape, generator=generator) * 2 + 0.5)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.bias.add_(0.5)
    return model.eval()


def _buffers(model):
    return {k: v for k, v in model.state_dict().items() if "running" in k}


def _data(arch, generator, n=48):
    return torch.randn(n, *SPECS[arch].input_shape, generator=generator)


def test_capture_modules_pools_every_dim_but_the_channels(generator):
    model = _model("vit", 0, generator)
    model.train()
    x = _data("vit", generator, 5)
    captured = capture_modules(
        model, x, [("levels.1", 1), ("levels.1.attention.q", -1)], batch_size=2, device="cpu"
    )
    assert model.training and all(m.training for m in model.modules())  # modes restored
    level = model.eval().forward_levels(model.forward_levels(x, 0, 1), 1, 2)
    assert torch.allclose(captured[("levels.1", 1)], output_rows(level), atol=1e-6)
    assert captured[("levels.1.attention.q", -1)].shape == (5 * 17, 32)
    with pytest.raises(ValueError, match="no modules named"):
        capture_modules(model, x, [("levels.9", 1)], device="cpu")


def test_reset_batchnorm_statistics_measures_the_fusion_set(generator):
    model = _model("resnet", 0, generator)
    x = _data("resnet", generator, 32)
    model.train()
    reset_batchnorm_statistics(model, x, batch_size=32, device="cpu")
    assert model.training and model.levels[0].bn.momentum == 0.1  # mode and momentum restored
    z = model.levels[0].conv(x)
    assert torch.allclose(model.levels[0].bn.running_mean, z.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(model.levels[0].bn.running_var, z.var((0, 2, 3)), atol=1e-4)
    vit = _model("vit", 0, generator)
    before = copy.deepcopy(vit.state_dict())
    reset_batchnorm_statistics(vit, _data("vit", generator), device="cpu")  # no BatchNorm
    assert all(torch.equal(v, before[k]) for k, v in vit.state_dict().items())


def test_block_maps_stay_inside_their_groups():
    cost = torch.rand(8, 8, generator=torch.Generator().manual_seed(1))
    cost[:4, 4:] = cost[4:, :4] = -10  # tempting, but across groups
    permutation = block_assignment(cost, groups=2)
    assert sorted(permutation[:4].tolist()) == [0, 1, 2, 3]
    assert sorted(permutation[4:].tolist()) == [4, 5, 6, 7]
    matrix, _ = block_transport(cost, groups=2)
    assert torch.equal(matrix[:4, 4:], torch.zeros(4, 4))
    assert torch.allclose(matrix.sum(1), torch.ones(8, dtype=torch.float64))


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("name", ALIGNING)
@pytest.mark.parametrize("reset", [False, True])
def test_a_permuted_copy_fuses_back_to_the_model(arch, name, reset, generator):
    model = _model(arch, 0, generator)
    permuted = permute_model(model, random_permutations(model, generator))
    x = _data(arch, generator)
    hidden = x
    with torch.no_grad():
        for level in model.levels[:-1] if arch == "resnet" else []:
            hidden = level(hidden)
            assert hidden.transpose(0, 1).flatten(1).amax(1).min() > 0  # no dead channel
    method = make_fusion_method(name, device="cpu", reset_batchnorm=reset)
    result = method.fuse([model, permuted], FusionInputs(data=x))
    assert result.details["path"] == "spaces"
    fused = result.model.eval()
    expected = model
    if reset and arch == "resnet":
        expected = reset_batchnorm_statistics(copy.deepcopy(model), x, device="cpu")
    for key, value in _buffers(expected).items():
        assert torch.allclose(_buffers(fused)[key], value, atol=1e-5), key
    probe = _data(arch, generator, 8)
    assert torch.allclose(fused(probe), expected(probe), atol=1e-4)
    if arch == "resnet" and reset:  # the reset really changed the statistics
        assert not torch.allclose(fused(probe), model(probe), atol=1e-4)


@pytest.mark.parametrize("arch", list(SPECS))
def test_otfusion_aligns_several_models_to_the_reference(arch, generator):
    model = _model(arch, 0, generator)
    copies = [permute_model(model, random_permutations(model, generator)) for _ in range(2)]
    method = make_fusion_method("otfusion", device="cpu", reset_batchnorm=False, reference=1)
    result = method.fuse([copies[0], model, copies[1]], FusionInputs(data=_data(arch, generator)))
    assert all(s["permutation"] for s in result.details["spaces"])
    probe = _data(arch, generator, 8)
    assert torch.allclose(result.model.eval()(probe), model(probe), atol=1e-4)


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("name", ["vanilla", "fedavg"])
def test_averaging_identical_residual_models_keeps_the_function(arch, name, generator):
    model = _model(arch, 0, generator)
    twin = copy.deepcopy(model)
    inputs = FusionInputs(sample_counts=[3, 5])
    fused = make_fusion_method(name).fuse([model, twin], inputs).model.eval()
    for key, value in model.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key  # num_batches_tracked too
    probe = _data(arch, generator, 8)
    assert torch.allclose(fused(probe), model(probe), atol=1e-6)


def test_averaging_integer_buffers_and_the_optional_batchnorm_reset(generator):
    a, b = _model("resnet", 0, generator), _model("resnet", 1, generator)
    with torch.no_grad():
        b.levels[0].bn.num_batches_tracked.fill_(4)
        a.levels[0].bn.num_batches_tracked.fill_(7)
    fused = make_fusion_method("vanilla").fuse([a, b]).model
    assert fused.levels[0].bn.num_batches_tracked.item() == 6  # round(5.5), an integer buffer
    assert fused.levels[0].bn.num_batches_tracked.dtype == torch.long
    method = make_fusion_method("fedavg", reset_batchnorm=True, device="cpu")
    assert "data" in method.requirements()
    with pytest.raises(ValueError, match="fusion set"):
        method.check_run(2, SPECS["resnet"], available={"sample_counts"})
    x = _data("resnet", generator)
    result = method.fuse([a, b], FusionInputs(data=x, sample_counts=[1, 1]))
    expected = reset_batchnorm_statistics(fused, x, device="cpu")
    for key, value in _buffers(expected).items():
        assert torch.allclose(_buffers(result.model)[key], value, atol=1e-5), key


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("name", [*ALIGNING, "vanilla", "fedavg"])
def test_check_run_accepts_residual_architectures(arch, name):
    make_fusion_method(name).check_run(2, SPECS[arch])


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("git-rebasin", {"use_scores": True}, "use_scores"),
        ("git-rebasin", {"repair": True}, "repair"),
        ("otfusion", {"ground_metric": "weights"}, "weights"),
        ("otfusion", {"repair": True}, "repair"),
        ("otfusion", {"use_scores": True}, "use_scores"),
    ],
)
def test_level_only_options_are_refused_on_residual_nets_before_training(name, options, match):
    with pytest.raises(ValueError, match=match):
        make_fusion_method(name, **options).check_run(2, SPECS["resnet"])
    make_fusion_method(name, **options).check_run(2, make_spec("mlp", (1, 28, 28), 10))


def test_the_generic_path_matches_the_level_path_on_an_mlp(generator):
    spec = make_spec("mlp", (1, 28, 28), 10, widths=(32, 16))
    a, b = build_model(spec, seed=1), build_model(spec, seed=2)
    inputs = FusionInputs(data=torch.randn(64, *spec.input_shape, generator=generator))
    for name in ALIGNING:
        method = make_fusion_method(name, device="cpu")
        levels, _ = method._fuse_levels([a, b], inputs, spec)
        spaces, _ = method._fuse_spaces([a, b], inputs, spec)
        for key, value in levels.state_dict().items():
            assert torch.allclose(spaces.state_dict()[key], value, atol=1e-6), (name, key)


def _train(model, x, y, steps, seed):
    torch.manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = torch.randint(len(x), (32,))
        optimiser.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimiser.step()
    return model.eval()


@pytest.mark.parametrize("arch", ["resnet", "vit"])
def test_aligned_fusion_beats_plain_averaging_of_independent_models(arch, generator):
    spec = (
        make_spec("resnet", (1, 8, 8), 2, depth=10, width_multiplier=1 / 16)
        if arch == "resnet"
        else make_spec("vit", (1, 8, 8), 2, patch=4, depth=1, heads=2, hidden=16, mlp=16)
    )
    x = torch.randn(384, *spec.input_shape, generator=generator)
    y = torch.randint(2, (384,), generator=generator)
    pattern = torch.randn(1, 8, 8, generator=generator)  # the class is the sign of a pattern
    x = x + 0.5 * (2 * y - 1)[:, None, None, None] * pattern
    models = [_train(build_model(spec, seed=s), x[:256], y[:256], 150, s) for s in (1, 2)]
    test_x, test_y = x[256:], y[256:]
    inputs = FusionInputs(data=x[:128])

    def loss(model):
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model.eval()(test_x), test_y))

    plain = loss(make_fusion_method("vanilla").fuse(models).model)
    for name in ALIGNING:
        fused = make_fusion_method(name, device="cpu").fuse(models, inputs).model
        assert loss(fused) < plain, (name, loss(fused), plain)
