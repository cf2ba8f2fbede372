"""ResNet and ViT as levels: composition, widths, depths, and their neuron symmetries."""

import pytest
import torch

from fedfuse.models import (
    ModelSpec,
    build_model,
    corresponding_levels,
    make_spec,
    mlp_spec,
    parameter_shapes,
)
from fedfuse.models.affine import affine_view, output_rows
from fedfuse.models.capture import LevelStream, capture_levels
from fedfuse.models.resnet import BasicBlock
from fedfuse.models.symmetry import (
    balance_attention,
    balance_query_key,
    balance_value_output,
    feature_spaces,
    map_state,
    permute_model,
    random_permutations,
)
from tests.helpers import assert_levels_compose

SPECS = {
    "resnet10-28x28x1": make_spec("resnet", (1, 28, 28), 10, depth=10, width_multiplier=1 / 8),
    "resnet18-32x32x3": make_spec("resnet", (3, 32, 32), 10, depth=18, width_multiplier=1 / 16),
    "resnet34-64x64x3-imagenet-stem": make_spec(
        "resnet", (3, 64, 64), 5, depth=34, width_multiplier=1 / 32, stem="imagenet"
    ),
    "vit-28x28x1": make_spec("vit", (1, 28, 28), 10, patch=7, depth=2, heads=4, hidden=32, mlp=48),
    "vit-32x32x3": make_spec("vit", (3, 32, 32), 10, patch=8, depth=3, heads=2, hidden=16, mlp=24),
    "vgg11": make_spec("vgg11", (1, 28, 28), 10, width_multiplier=1 / 16),
    "mlp": make_spec("mlp", (1, 28, 28), 10, widths=(32, 16)),
}


def _trained_statistics(model, spec, generator):
    """Give BatchNorm layers non-trivial running statistics (a few forward passes in train)."""
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, *spec.input_shape, generator=generator) * 2 + 0.5)
    return model.eval()


@pytest.mark.parametrize("name", [n for n in SPECS if n.startswith(("resnet", "vit"))])
def test_levels_compose_to_the_forward_pass(name, generator):
    spec = SPECS[name]
    model = _trained_statistics(build_model(spec, seed=0), spec, generator)
    x = torch.randn(4, *spec.input_shape, generator=generator)
    assert_levels_compose(model, x, spec.num_classes)
    # every level owns neurons, and their count is the spec's width (classes for the head)
    assert model.neuron_levels == list(range(model.num_levels))
    assert affine_view(model.levels[-1]) is not None  # the head takes closed-form fits
    captured = capture_levels(model, x, device="cpu")
    for index in model.neuron_levels:
        assert captured[index].outputs.shape[1] == model.level_width(index)


def test_resnet_depths_and_stems():
    for depth, blocks in ((10, 4), (18, 8), (34, 16)):
        spec = make_spec("resnet", (3, 32, 32), 10, depth=depth)
        model = build_model(spec, device="meta")
        assert model.num_levels == blocks + 2  # stem, blocks, head
        assert spec.widths[:2] == (64, 64) and spec.widths[-1] == 512
    spec = make_spec("resnet", (1, 28, 28), 10, depth=18, width_multiplier=0.25)
    assert spec.options["stem"] == "cifar" and spec.widths[0] == 16
    model = build_model(spec)
    assert model.level_stages() == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4]
    identity = [isinstance(m, BasicBlock) and m.identity_shortcut for m in model.levels]
    assert identity == [False, True, True, False, True, False, True, False, True, False]
    assert [model.is_residual(i) for i in range(model.num_levels)] == identity
    with pytest.raises(ValueError, match="depth must be one of"):
        make_spec("resnet", (3, 32, 32), 10, depth=20)
    with pytest.raises(ValueError, match="stem must be one of"):
        make_spec("resnet", (3, 32, 32), 10, stem="huge")


def test_vit_paper_defaults_and_errors():
    spec = make_spec("vit", (3, 32, 32), 100)  # the paper's CIFAR ViT
    assert spec.options == {"patch": 8, "heads": 12, "mlp": 384}
    assert spec.widths == (384,) * 8  # embedding + 7 blocks
    shapes = parameter_shapes(spec)
    assert shapes["levels.0.position"] == (384, 17)  # 16 patches + the class token
    assert shapes["levels.8.2.weight"] == (100, 384)
    # the paper's patch 8 on 28x28 inputs: padded to 32x32, 16 patches
    padded = build_model(make_spec("vit", (1, 28, 28), 10, patch=8, hidden=24, heads=2, depth=1))
    assert padded.levels[0].position.shape == (24, 17)
    assert padded(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="heads do not divide"):
        build_model(make_spec("vit", (1, 28, 28), 10, patch=7, hidden=30, heads=4))
    with pytest.raises(ValueError, match="all equal"):
        build_model(ModelSpec("vit", (1, 28, 28), 10, (32, 16), spec.options))


def test_vit_levels_keep_tokens_channels_first_so_rows_pool_over_tokens(generator):
    spec = SPECS["vit-28x28x1"]
    model = build_model(spec, seed=0).eval()
    x = torch.randn(3, *spec.input_shape, generator=generator)
    out = capture_levels(model, x, [1], device="cpu")[1].outputs
    assert out.shape == (3, 32, 17)  # (samples, hidden, 1 + 16 patches)
    rows = output_rows(out)
    assert rows.shape == (3 * 17, 32)  # one row per token: the neurons pooled over tokens
    assert torch.equal(rows[1], out[0, :, 1])


@pytest.mark.parametrize("name", list(SPECS))
def test_permuting_every_feature_space_keeps_the_function(name, generator):
    spec = SPECS[name]
    model = _trained_statistics(build_model(spec, seed=0), spec, generator)
    permutations = random_permutations(model, generator)
    permuted = permute_model(model, permutations)
    x = torch.randn(6, *spec.input_shape, generator=generator)
    assert torch.allclose(permuted(x), model(x), atol=1e-5)
    moved = [
        k for k, v in permuted.state_dict().items() if not torch.equal(v, model.state_dict()[k])
    ]
    assert moved, "the permutation changed no tensor"
    # BatchNorm running statistics travel with their channels
    for space in feature_spaces(model):
        for axis in space.axes:
            if axis.key.endswith("running_var"):
                order = permutations[space.name]
                assert torch.equal(
                    permuted.state_dict()[axis.key], model.state_dict()[axis.key][order]
                )


def test_feature_spaces_cover_residual_streams_and_attention_heads():
    resnet = build_model(SPECS["resnet18-32x32x3"], device="meta")
    names = [s.name for s in feature_spaces(resnet)]
    # stem + stage 0 share one stream; each later stage starts its own at its projection block
    assert [n for n in names if n.startswith("stream")] == [
        "stream0",
        "stream3",
        "stream5",
        "stream7",
    ]
    assert sum(n.endswith(".inner") for n in names) == 8
    vit = build_model(SPECS["vit-32x32x3"], device="meta")
    spaces = {s.name: s for s in feature_spaces(vit)}
    assert spaces["stream"].size == 16 and spaces["block1.qk"].groups == 2
    head_keys = {a.key for a in spaces["stream"].axes}
    assert {"levels.0.class_token", "levels.0.position", "levels.4.2.weight"} <= head_keys


def test_a_permutation_outside_the_attention_heads_breaks_the_function(generator):
    """The head groups are real constraints: mixing dims across heads changes the output."""
    spec = SPECS["vit-28x28x1"]
    model = build_model(spec, seed=0).eval()
    space = next(s for s in feature_spaces(model) if s.name == "block1.qk")
    swap = torch.arange(space.size)
    swap[[0, space.size - 1]] = swap[[space.size - 1, 0]]  # dim 0 of head 0 <-> last of head 3
    state = map_state(model.state_dict(), space, torch.eye(space.size, dtype=torch.float64)[swap])
    broken = build_model(spec)
    broken.load_state_dict(state)
    x = torch.randn(4, *spec.input_shape, generator=generator)
    assert not torch.allclose(broken.eval()(x), model(x), atol=1e-4)


def test_balancing_attention_keeps_the_function_and_equalises_each_channel_pair(generator):
    spec = SPECS["vit-28x28x1"]
    model = build_model(spec, seed=0).eval()
    attention = model.levels[1].attention
    scales = torch.logspace(-3, 3, attention.v.out_features)
    with torch.no_grad():  # a factorisation of the same products as a closed-form fit leaves it
        attention.q.weight.mul_(scales[:, None])
        attention.q.bias.mul_(scales)
        attention.k.weight.div_(scales[:, None])
        attention.k.bias.div_(scales)
        attention.v.weight.mul_(scales[:, None])
        attention.v.bias.mul_(scales)
        attention.out.weight.div_(scales)
    x = torch.randn(8, *spec.input_shape, generator=generator)
    before = model(x)
    balance_query_key(attention)  # each half on its own, with the parameters requiring grad
    balance_value_output(attention)
    balance_attention(attention)  # both again: a balanced pair stays as it is
    torch.testing.assert_close(model(x), before, atol=1e-4, rtol=1e-4)

    def norms(layer):
        return (layer.weight.pow(2).sum(1) + layer.bias.pow(2)).sqrt()

    torch.testing.assert_close(norms(attention.q), norms(attention.k))
    torch.testing.assert_close(norms(attention.v), attention.out.weight.norm(dim=0))
    assert norms(attention.v).max() / norms(attention.v).min() < 10  # was 10^6


def test_map_state_changes_widths_and_names_a_bad_map():
    spec = SPECS["mlp"]
    model = build_model(spec, seed=0)
    space = feature_spaces(model)[0]
    merge = torch.zeros(24, 32, dtype=torch.float64)
    merge[torch.arange(24), torch.arange(24)] = 1
    state = map_state(model.state_dict(), space, merge)
    narrow = build_model(spec.with_widths((24, 16)))
    narrow.load_state_dict(state)  # shapes fit the narrower spec
    with pytest.raises(ValueError, match="space level0 has 32 features"):
        map_state(model.state_dict(), space, torch.eye(31))


def test_models_of_different_depths_correspond_stage_by_stage():
    small = build_model(make_spec("resnet", (3, 32, 32), 10, depth=18), device="meta")
    large = build_model(make_spec("resnet", (3, 32, 32), 10, depth=34), device="meta")
    mapping = corresponding_levels(large, small)
    # stem, then per stage the ResNet-18's 2 blocks take the middle and last ResNet-34 block
    assert mapping == {0: 0, 1: 2, 2: 3, 3: 5, 4: 7, 5: 10, 6: 13, 7: 15, 8: 16, 9: 17}
    assert corresponding_levels(small, small) == {i: i for i in range(10)}
    vit = build_model(SPECS["vit-28x28x1"], device="meta")
    assert all(vit.is_residual(i) for i in (1, 2)) and not vit.is_residual(0)
    with pytest.raises(ValueError, match="no level-by-level or stage-by-stage"):
        corresponding_levels(vit, small)


def test_resnet_checkpoints_round_trip_with_their_batchnorm_counters(tmp_path, generator):
    from fedfuse.io.checkpoint import load_checkpoint, save_checkpoint
    from fedfuse.io.validation import ContributionError, validate_state_dict

    spec = SPECS["resnet10-28x28x1"]
    model = _trained_statistics(build_model(spec, seed=0), spec, generator)
    path = tmp_path / "site.safetensors"
    save_checkpoint(path, model)
    loaded = load_checkpoint(path).model.eval()
    x = torch.randn(3, *spec.input_shape, generator=generator)
    assert torch.equal(loaded(x), model(x))
    assert loaded.state_dict()["levels.0.bn.num_batches_tracked"].item() == 3
    state = model.state_dict()
    with pytest.raises(ContributionError, match="counter; expected an integer"):
        validate_state_dict(
            spec, {**state, "levels.0.bn.num_batches_tracked": torch.tensor(1.0)}, source="site 2"
        )
    bad_var = state["levels.0.bn.running_var"].clone()
    bad_var[0] = -1
    with pytest.raises(ContributionError, match="site 2: .*negative variances"):
        validate_state_dict(spec, {**state, "levels.0.bn.running_var": bad_var}, source="site 2")


def test_a_level_stream_gives_the_captured_levels_one_at_a_time():
    spec = make_spec("resnet", (3, 16, 16), 10, depth=10, width_multiplier=0.25)
    model = build_model(spec, seed=0)
    x = torch.randn(9, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    captured = capture_levels(model, x, batch_size=4, device="cpu")
    stream = LevelStream(model, x, batch_size=4, device="cpu")
    for index in (0, 2, 3, model.num_levels - 1):  # levels skipped are run, not kept
        level = stream.level(index)
        assert torch.equal(level.outputs, captured[index].outputs)
        assert torch.equal(level.inputs, captured[index].inputs)
    with pytest.raises(ValueError, match="levels come in order"):
        stream.level(1)


def test_a_level_stream_may_write_its_next_level_over_the_tensor_it_goes_on_from():
    """Writing a level's outputs over the last level's (``out`` is the tensor the stream goes
    on from, as many models' equal-width levels share one) gives the captured values."""
    spec = mlp_spec((1, 4, 4), 3, (8, 8, 8))
    model = build_model(spec, seed=0)
    x = torch.randn(10, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    captured = capture_levels(model, x, batch_size=3, device="cpu")
    stream = LevelStream(model, x, batch_size=3, device="cpu", keep_inputs=False)
    neurons = [i for i, level in enumerate(model.levels) if captured[i].outputs.shape == (10, 8)]
    shared = torch.empty(10, 8)
    for index in neurons:
        level = stream.level(index, out=shared)
        assert level.outputs.data_ptr() == shared.data_ptr()
        assert torch.allclose(shared, captured[index].outputs, atol=1e-6), index
