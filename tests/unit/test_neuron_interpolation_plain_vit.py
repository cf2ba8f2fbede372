"""The closed-form neuron-interpolation methods on a user's own Vision Transformer (issue 49,
item 2): torchvision's ``VisionTransformer`` read off its traced graph as fedfuse's ViT levels
(patch embedding, encoder blocks of attention and MLP, norm and classifier), fitted by the same
pieces, and returned as the user's class."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

from fedfuse.experiments.user_models import as_fedfuse_model
from fedfuse.fusion import FusionInputs, LocalSites, make_fusion_method
from fedfuse.fusion.blocks.graph_pieces import fold_norm_levels
from fedfuse.fusion.blocks.pieces import linear_pieces
from fedfuse.fusion.blocks.token_levels import TokenEmbedding, TokenEncoder, TokenHead
from fedfuse.models import LeveledModel, ModelAdapter, importance_scores, make_spec
from tests.helpers import SmallViT, prototype_task, trained_small_vit

SHAPE = (1, 28, 28)
CLASSES = 4


def _task(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return prototype_task(samples, seed, SHAPE, CLASSES)


@pytest.fixture(scope="module")
def sites():
    return [trained_small_vit(0), trained_small_vit(1)]


@pytest.fixture(scope="module")
def fusion_set():
    return _task(160, 99)


def test_the_levels_are_read_as_fedfuses_vit_levels():
    adapted = ModelAdapter(SmallViT, SHAPE).adapt(SmallViT().eval())
    view, where = fold_norm_levels(adapted)
    kinds = [TokenEmbedding, TokenEncoder, TokenEncoder, TokenHead]
    assert [type(level) for level in view.levels] == kinds
    assert [view.level_name(i) for i in view.neuron_levels] == [
        "0:conv_proj",
        "1:encoder.layers.encoder_layer_0",
        "2:encoder.layers.encoder_layer_1",
        "3:heads.head",
    ]
    assert sorted(set(where.values())) == [0, 1, 2, 3]
    assert [view.is_residual(i) for i in view.neuron_levels] == [False, True, True, False]
    assert view.spec.widths == (32, 32, 32)
    names = [[p.name for p in linear_pieces(level)] for level in view.levels]
    assert names[1] == ["q+k", "v+out", "out", "fc1", "fc2"]  # fedfuse's own ViT block's
    x = torch.randn(3, *SHAPE)
    with torch.no_grad():
        assert torch.equal(view.eval()(x), adapted.eval()(x))


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_fusing_identical_copies_gives_the_model_back(sites, fusion_set, method):
    model = sites[0]
    copy = SmallViT()
    copy.load_state_dict(model.state_dict())
    data = fusion_set[0]
    fused = make_fusion_method(method, use_scores=False).fuse(
        [model, copy.eval()], FusionInputs(data)
    )
    assert type(fused.model) is SmallViT
    with torch.no_grad():
        expected, got = model(data), fused.model.eval()(data)
    assert torch.allclose(got, expected, atol=1e-3 * float(expected.abs().max()))


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_two_sites_fuse_into_the_users_class_better_than_averaging(sites, fusion_set, method):
    data, labels = fusion_set
    inputs = FusionInputs(data, labels=labels)
    fused = make_fusion_method(method).fuse(sites, inputs).model
    fresh = SmallViT()
    fresh.load_state_dict(fused.state_dict())  # strict: the user's names and shapes
    averaged = make_fusion_method("vanilla").fuse(sites, inputs).model
    with torch.no_grad():
        logits = fresh.eval()(data)
        loss = nn.functional.cross_entropy(logits, labels)
        average_loss = nn.functional.cross_entropy(averaged.eval()(data), labels)
        site_losses = [nn.functional.cross_entropy(s(data), labels) for s in sites]
    assert torch.isfinite(logits).all()
    assert max(site_losses) < 0.6 * average_loss  # the sites disagree: averaging hurts
    assert loss < 0.6 * average_loss  # 0.04 (kf and hf) against 0.46


def test_torchvisions_own_vit_is_taken_by_the_linear_variants():
    def build():
        return VisionTransformer(28, 7, 2, 2, 32, 64, num_classes=10)

    adapter = ModelAdapter(build, (3, 28, 28), name="test-torchvision-vit").register()
    for method in ("kf-linear", "hf-linear"):
        make_fusion_method(method).check_run(2, adapter.spec)


class _Roll(nn.Module):
    """A custom op on the MLP's hidden channels: no permutation of them keeps the function."""

    def forward(self, x):
        return x.roll(1, -1)


class _RolledViT(SmallViT):
    def __init__(self) -> None:
        super().__init__()
        self.encoder.layers[1].mlp[1] = _Roll()


class _PreLogitsViT(VisionTransformer):
    """torchvision's ViT with a representation layer (Linear, Tanh) before the classifier."""

    def __init__(self) -> None:
        super().__init__(28, 7, 1, 2, 32, 64, num_classes=CLASSES, representation_size=16)


class _SequenceFirst(nn.Module):
    """Attention written sequence-first (transposes around it) and a shape check: no ViT part
    reads it, and the refusal names its first op no piece takes, not the check."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.fc = nn.Linear(16, 16), nn.Linear(16, CLASSES)
        self.ln, self.attention = nn.LayerNorm(16), nn.MultiheadAttention(16, 2)

    def forward(self, x):
        tokens = self.proj(x.view(x.size(0), 4, 16))
        torch._assert(tokens.dim() == 3, "tokens")
        h = self.ln(tokens).transpose(0, 1)
        tokens = tokens + self.attention(h, h, h, need_weights=False)[0].transpose(0, 1)
        return self.fc(tokens.mean(1))


@pytest.mark.parametrize(
    ("model", "shape", "expected"),
    [
        (_RolledViT, SHAPE, r"level 8:encoder\.layers\.encoder_layer_1 is no MLP .*'roll'"),
        (_PreLogitsViT, (3, 28, 28), r"level 7:encoder_ln is no ViT head .*'heads_act', Tanh"),
        (_SequenceFirst, (1, 8, 8), r"level 2:.*neither affine.*node 'ln', LayerNorm, is none"),
    ],
)
def test_a_part_no_piece_reads_is_refused_naming_the_level_and_the_op(model, shape, expected):
    spec = ModelAdapter(model, shape).register().spec
    for method in ("kf-linear", "hf-linear"):
        with pytest.raises(ValueError, match=expected) as error:
            make_fusion_method(method).check_run(2, spec)
        assert "\n" not in str(error.value)


def test_kf_sites_takes_it_too(sites, fusion_set):
    """The sites' statistics rounds fold the model as the server does, into the same levels."""
    data, labels = fusion_set
    site_data = [_task(256, seed)[0] for seed in (0, 1)]
    inputs = FusionInputs(
        data, labels=labels, sites=LocalSites(sites, site_data), sample_counts=[256, 256]
    )
    fused = make_fusion_method("kf-sites").fuse(sites, inputs).model
    fresh = SmallViT()
    fresh.load_state_dict(fused.state_dict())
    averaged = make_fusion_method("vanilla").fuse(sites, inputs).model
    with torch.no_grad():
        loss = nn.functional.cross_entropy(fresh.eval()(data), labels)
        average_loss = nn.functional.cross_entropy(averaged.eval()(data), labels)
    assert loss < 0.6 * average_loss  # 0.06 against 0.46


def test_deeplift_scores_of_its_token_levels_weight_the_fit(sites, fusion_set):
    """The sites' scores: a token level's neurons are its last dim (``(N, tokens, d)``)."""
    data, labels = fusion_set
    adapter = ModelAdapter(SmallViT, SHAPE).register()
    scores = [importance_scores(adapter.adapt(s), data[:32], method="deeplift") for s in sites]
    leveled = adapter.adapt(sites[0])
    assert all(len(s[i]) == leveled.level_width(i) for s in scores for i in s)
    assert len(scores[0][6]) == 32  # the first block's stream, not its 17 tokens
    inputs = FusionInputs(data, labels=labels, scores=scores)
    fused = make_fusion_method("kf-linear").fuse(sites, inputs).model
    averaged = make_fusion_method("vanilla").fuse(sites, inputs).model
    with torch.no_grad():
        loss = nn.functional.cross_entropy(fused.eval()(data), labels)
        average_loss = nn.functional.cross_entropy(averaged.eval()(data), labels)
    assert loss < 0.6 * average_loss


def _as_fedfuses_vit(model: SmallViT) -> LeveledModel:
    """``model``'s function in fedfuse's own ViT (the library's copy, as the experiments use)."""
    spec = make_spec("vit", SHAPE, CLASSES, patch=7, depth=2, heads=2, hidden=32, mlp=64)
    return as_fedfuse_model(model, spec)


def test_it_fuses_as_the_same_weights_in_fedfuses_own_vit(sites, fusion_set):
    """The graph's levels are fitted by the same pieces as fedfuse's ViT: the same function."""
    data, labels = fusion_set
    owns = [_as_fedfuses_vit(site) for site in sites]
    with torch.no_grad():
        assert torch.allclose(owns[0](data), sites[0](data), atol=1e-4)
    inputs = FusionInputs(data, labels=labels)
    fused = make_fusion_method("kf-linear").fuse(sites, inputs).model
    own = make_fusion_method("kf-linear").fuse(owns, inputs).model
    with torch.no_grad():
        expected, got = own.eval()(data), fused.eval()(data)
    # float32 rounding apart (about 1e-3 of the logits): the packed and the split projections
    assert torch.allclose(got, expected, atol=1e-2 * float(expected.abs().max()))


def test_regmean_merges_torchvisions_attention_as_fedfuses_own_vit(sites):
    """nn.MultiheadAttention applies its packed q/k/v and out projections as functions; their
    inputs are recorded from the attention module's own (the query, the heads' mixed values),
    so RegMean merges them by Grams, as the same weights in fedfuse's ViT (q, k, v, out
    Linears) are merged: the same function, float32 rounding apart."""
    from fedfuse.federation import site_fusion_inputs

    data = [_task(40, seed) for seed in (3, 4)]
    result = make_fusion_method("regmean").fuse(sites, site_fusion_inputs(sites, data, "regmean"))
    assert "averaged_attention" not in result.details
    owns = [_as_fedfuses_vit(site) for site in sites]
    own = make_fusion_method("regmean").fuse(owns, site_fusion_inputs(owns, data, "regmean"))
    x = _task(30, 9)[0]
    with torch.no_grad():
        expected, got = own.model.eval()(x), result.model.eval()(x)
    assert torch.allclose(got, expected, atol=1e-2 * float(expected.abs().max()))
    averaged = make_fusion_method("vanilla").fuse(sites, FusionInputs(x)).model.eval()
    with torch.no_grad():  # and not what averaging the attention would give
        assert not torch.allclose(averaged(x), expected, atol=1e-2 * float(expected.abs().max()))


class _BiasedKV(nn.Module):
    """Self-attention with extra key/value biases, which the packed projection does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.attention = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        tokens = self.embed(x.reshape(-1, 4, 6))
        return self.head(self.attention(tokens, tokens, tokens, need_weights=False)[0].mean(1))


class _CrossAttention(nn.Module):
    """Tokens attending over another embedding of the input (not self-attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.memory = nn.Linear(6, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        rows = x.reshape(-1, 4, 6)
        tokens, memory = self.embed(rows), self.memory(rows)
        return self.head(self.attention(tokens, memory, memory, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("model_class", [_BiasedKV, _CrossAttention])
def test_an_attention_that_cannot_be_packed_is_averaged_and_named(model_class, caplog):
    """Extra key/value biases have no place in the packed projection's Gram, and attention over
    another tensor has no one input to take it from: RegMean averages such an attention and
    says which."""
    from fedfuse.federation import site_fusion_inputs

    torch.manual_seed(0)
    models = [model_class().eval(), model_class().eval()]
    data = [(torch.randn(20, 24), torch.randint(0, 3, (20,))) for _ in models]
    with caplog.at_level("WARNING", logger="fedfuse.fusion.methods.regression.regmean"):
        inputs = site_fusion_inputs(models, data, "regmean")
        result = make_fusion_method("regmean").fuse(models, inputs)
    assert any(name.endswith("attention") for name in result.details["averaged_attention"])
    assert "averaged, not merged by their Grams" in caplog.text


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_the_recorded_out_proj_input_is_the_one_the_attention_applies(batch_first, masked):
    """out_proj applied to the recomputed mixed values gives the attention's own output."""
    from fedfuse.models.packed_attention import _mixed_values

    torch.manual_seed(1)
    attention = nn.MultiheadAttention(8, 2, batch_first=batch_first).eval()
    x = torch.randn(3, 5, 8) if batch_first else torch.randn(5, 3, 8)
    options = {"key_padding_mask": torch.rand(3, 5) < 0.3} if masked else {}
    if masked:
        options["key_padding_mask"][:, 0] = False  # every query sees a key
    with torch.no_grad():
        output = attention(x, x, x, need_weights=False, **options)[0]
        mixed = _mixed_values(attention, x, options)
        assert torch.allclose(attention.out_proj(mixed), output, atol=1e-5)
