"""The math of site-statistics fusion: statistics add up over sites, the fit is the pooled
least-squares fit, GCV is what its formula says, identical sites give the model back, and a
site's bad or missing statistics are named."""

from __future__ import annotations

import copy

import pytest
import torch

from fedfuse.fusion import HFSites, KFSites, LocalSites, StatisticsRequest, site_statistics
from fedfuse.fusion.blocks.batchnorm import batchnorm_input_statistics
from fedfuse.fusion.blocks.least_squares import ridge_fit, weighted_least_squares
from fedfuse.fusion.inputs import FusionInputs
from fedfuse.fusion.statistics.on_site import compress_gram
from fedfuse.fusion.statistics.rounds import SiteStatistics
from fedfuse.models import build_model, make_spec, mlp_spec, vgg11_spec
from fedfuse.models.affine import affine_view
from fedfuse.models.symmetry import permute_model, random_permutations
from tests.helpers import randn

SPEC = mlp_spec((1, 3, 3), 3, (7, 6))


def _request(level: int, fused, dtype: str = "float64") -> StatisticsRequest:
    return StatisticsRequest(level, fused, dtype=dtype)


@pytest.mark.parametrize("level", [0, 2, 4])
def test_statistics_of_two_sites_add_up_to_those_of_the_pooled_data(level):
    model, fused = build_model(SPEC, seed=0), build_model(SPEC, seed=1)
    a, b = randn(1, 20, 1, 3, 3), randn(2, 13, 1, 3, 3)
    parts = [site_statistics(model, d, _request(level, fused), device="cpu") for d in (a, b)]
    pooled = site_statistics(model, torch.cat([a, b]), _request(level, fused), device="cpu")
    assert pooled.rows == sum(p.rows for p in parts) == 33
    for name in ("gram", "cross", "target_gram"):
        total = sum(getattr(p, name) for p in parts)
        torch.testing.assert_close(getattr(pooled, name), total, rtol=1e-6, atol=1e-6)


def test_conv_statistics_add_up_over_sites_and_count_positions():
    spec = vgg11_spec((1, 8, 8), 3, width_multiplier=1 / 16)
    model, fused = build_model(spec, seed=0), build_model(spec, seed=1)
    a, b = randn(3, 4, 1, 8, 8), randn(4, 3, 1, 8, 8)
    level = fused.neuron_levels[1]
    parts = [site_statistics(model, d, _request(level, fused), device="cpu") for d in (a, b)]
    pooled = site_statistics(model, torch.cat([a, b]), _request(level, fused), device="cpu")
    positions = fused.forward_levels(a[:1], 0, level + 1).shape[-2:].numel()
    assert pooled.rows == 7 * positions
    torch.testing.assert_close(pooled.gram, parts[0].gram + parts[1].gram, rtol=1e-6, atol=1e-5)


def test_gcv_values_are_the_formula_on_the_design_and_the_fit_is_the_ridge_solution():
    x, t = randn(5, 40, 6).double(), randn(6, 40, 3).double()
    grid = (0.0, 1e-3, 1e-2, 1e-1, 1.0)
    fit = ridge_fit(x.T @ x, x.T @ t, (t**2).sum(0), len(x), grid=grid)
    scale = float((x.T @ x).trace()) / 6
    for relative, value in zip(grid, fit.criterion, strict=True):
        penalty = relative * scale
        hat = x.double() @ torch.linalg.solve(
            (x.T @ x).double() + penalty * torch.eye(6, dtype=torch.float64), x.double().T
        )
        rss = float(((t.double() - hat @ t.double()) ** 2).sum())
        expected = 40 * rss / (40 - float(hat.trace())) ** 2
        assert value == pytest.approx(expected, rel=1e-8)
    direct = weighted_least_squares(x, t, ridge=fit.ridge * scale)
    torch.testing.assert_close(fit.weights, direct, rtol=1e-8, atol=1e-10)


def test_the_gcv_choice_is_the_brute_force_leave_one_out_choice():
    x = randn(7, 200, 5).double()
    truth = randn(8, 5, 2) * torch.tensor([3.0, 0.1, 0.05, 0.0, 0.0])[:, None]
    t = x @ truth.double() + 2.0 * randn(9, 200, 2).double()
    grid = (0.0, 0.01, 0.1, 0.3, 1.0, 3.0, 10.0)
    chosen = ridge_fit(x.T @ x, x.T @ t, (t**2).sum(0), len(x), grid=grid).ridge
    scale = float((x.T @ x).trace()) / 5

    def loo(relative: float) -> float:
        error = 0.0
        for i in range(len(x)):
            keep = torch.arange(len(x)) != i
            w = weighted_least_squares(x[keep], t[keep], ridge=relative * scale)
            error += float(((x[i].double() @ w - t[i].double()) ** 2).sum())
        return error

    assert chosen == min(grid, key=loo)
    assert chosen > 0  # the noise makes the ridge worth it: the test checks a real choice


@pytest.mark.parametrize("method", [KFSites, HFSites])
def test_sites_that_all_hold_the_same_model_get_it_back(method):
    model = build_model(SPEC, seed=3).eval()
    count = 2 if method is HFSites else 3
    data = [randn(10 + k, 60, 1, 3, 3) for k in range(count)]  # full-rank inputs
    sites = LocalSites([copy.deepcopy(model) for _ in data], data, device="cpu")
    result = method(use_scores=False, statistics_dtype="float64").fuse(
        [copy.deepcopy(model) for _ in data], FusionInputs(sites=sites)
    )
    fused = result.model
    # the same neurons in the same order, the same function on the sites' data; weights on
    # inputs that are zero on every site (a ReLU dead there) are not determined by the data
    first = model.neuron_levels[0]
    torch.testing.assert_close(
        affine_view(fused.levels[first]).weights(), affine_view(model.levels[first]).weights()
    )
    with torch.no_grad():
        for inputs in data:
            torch.testing.assert_close(fused(inputs), model(inputs), rtol=1e-5, atol=1e-5)
    assert all(level["ridge"] <= 1e-8 for level in result.details["levels"])


def test_the_classifier_is_the_pooled_least_squares_fit_of_each_sites_own_logits():
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1)]
    data = [randn(20, 30, 1, 3, 3), randn(21, 25, 1, 3, 3)]
    result = KFSites(use_scores=False, ridge=0.0, statistics_dtype="float64").fuse(
        models, FusionInputs(sites=LocalSites(models, data, device="cpu"))
    )
    fused = result.model
    head = fused.neuron_levels[-1]
    with torch.no_grad():
        design = torch.cat([fused.forward_levels(d, 0, head) for d in data]).double()
        design = torch.cat([design, torch.ones(len(design), 1, dtype=design.dtype)], 1)
        targets = torch.cat([m(d) for m, d in zip(models, data, strict=True)]).double()
    expected = weighted_least_squares(design, targets)
    weights = affine_view(fused.levels[head]).weights().double()
    torch.testing.assert_close(weights, expected, rtol=1e-4, atol=1e-4)


def test_each_round_records_the_bytes_every_site_uploaded():
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1, 2)]
    data = [randn(30 + k, 20, 1, 3, 3) for k in range(3)]
    result = KFSites(use_scores=False).fuse(
        models, FusionInputs(sites=LocalSites(models, data, device="cpu"))
    )
    rounds = result.details["rounds"]
    assert len(rounds) == len(models[0].neuron_levels)
    fan_in, width = 10, 7  # first level: 9 pixels + bias -> 7 neurons, float32 on the wire
    expected = 4 * (fan_in * fan_in + 2 * fan_in * width + width * width)
    assert rounds[0]["upload_bytes"] == {"0": expected, "1": expected, "2": expected}


class _FaultySites(LocalSites):
    """Site 1 answers with a broken statistic, or not at all."""

    def __init__(self, *args, fault: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fault = fault

    def gather(self, request):
        replies = super().gather(request)
        if self.fault == "silent":
            self.problems.append("site 1: no reply before the reply timeout")
            replies[1] = None
        elif self.fault == "nan":
            replies[1].gram[0, 0] = float("nan")
        elif self.fault == "shape":
            replies[1].cross = replies[1].cross[:, :-1]
        return replies


@pytest.mark.parametrize(
    ("fault", "message"), [("nan", "site 1: statistic 'gram' has NaN"), ("shape", "'cross'")]
)
def test_a_broken_statistic_is_named(fault, message):
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1)]
    data = [randn(40 + k, 20, 1, 3, 3) for k in range(2)]
    sites = _FaultySites(models, data, device="cpu", fault=fault)
    with pytest.raises(ValueError, match=message):
        KFSites(use_scores=False).fuse(models, FusionInputs(sites=sites))


def test_a_silent_site_is_dropped_by_kf_and_named_by_hf():
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1, 2)]
    data = [randn(50 + k, 20, 1, 3, 3) for k in range(3)]
    sites = _FaultySites(models, data, device="cpu", fault="silent")
    result = KFSites(use_scores=False).fuse(models, FusionInputs(sites=sites))
    assert result.details["levels"][0]["dropped_sites"] == [1]
    assert all(level["sites"] == [0, 2] for level in result.details["levels"])
    assert "site 1: no reply" in result.details["problems"][0]
    assert result.missing_sites(3) == [1]  # the run reports kf-sites as partial for it
    two = _FaultySites(models[:2], data[:2], device="cpu", fault="silent")
    with pytest.raises(ValueError, match="site 1: no reply"):
        HFSites(use_scores=False).fuse(models[:2], FusionInputs(sites=two))


def test_site_statistics_validate_themselves():
    stats = SiteStatistics(0, 5, torch.eye(3), torch.ones(3, 2), torch.eye(2), torch.ones(3, 2))
    stats.check(3, 2, source="site 4")
    with pytest.raises(ValueError, match="site 4: statistic 'cross' of level 0 piece 0 has shape"):
        stats.check(3, 3, source="site 4")
    stats.target_gram[1, 1] = float("inf")
    with pytest.raises(ValueError, match="site 4: statistic 'target_gram' has NaN/Inf"):
        stats.check(3, 2, source="site 4")


def test_a_compressed_gram_keeps_the_top_spectrum_and_the_trace():
    x = randn(60, 50, 8).double() * torch.linspace(3, 0.1, 8).double()
    gram = x.T @ x
    factor, floor = compress_gram(gram, 3)
    stats = SiteStatistics(0, 50, factor, torch.ones(8, 2), torch.eye(2), torch.ones(8, 2))
    stats.gram_floor = floor
    assert stats.compressed and factor.shape == (8, 3)
    full = stats.full_gram()
    exact, approx = torch.linalg.eigvalsh(gram), torch.linalg.eigvalsh(full)
    torch.testing.assert_close(approx[-3:], exact[-3:])
    torch.testing.assert_close(approx[:-3], torch.full((5,), floor, dtype=torch.float64))
    torch.testing.assert_close(full.trace(), gram.trace())
    # a Gram of rank <= r is reconstructed exactly
    low = x[:, :2] @ x[:, :2].T
    factor, floor = compress_gram(low.T @ low, 3)
    exact_stats = SiteStatistics(0, 50, factor, torch.ones(50, 2), torch.eye(2), torch.ones(50, 2))
    exact_stats.gram_floor = floor
    torch.testing.assert_close(exact_stats.full_gram(), low.T @ low, rtol=1e-9, atol=1e-6)


def test_compressed_grams_upload_fewer_bytes():
    models = [build_model(SPEC, seed=s).eval() for s in (0, 1)]
    data = [randn(70 + k, 40, 1, 3, 3) for k in range(2)]
    full, compressed = (
        KFSites(use_scores=False, gram_rank=rank).fuse(
            models, FusionInputs(sites=LocalSites(models, data, device="cpu"))
        )
        for rank in (None, 4)
    )
    sent = [r["upload_bytes"]["0"] for r in compressed.details["rounds"]]
    whole = [r["upload_bytes"]["0"] for r in full.details["rounds"]]
    # every level is wider than 4 inputs: each Gram goes as a 4-column factor
    assert all(s < w for s, w in zip(sent, whole, strict=True))
    assert sent[0] == 4 * (10 * 4 + 2 * 10 * 7 + 7 * 7)


# ------------------------------------------------------------------ ResNet blocks, piece by piece
RESNET = make_spec("resnet", (1, 12, 12), 4, depth=10, width_multiplier=1 / 16)


def _resnet(seed: int):
    """A ResNet with non-trivial BatchNorm statistics (train-mode passes on shifted data)."""
    model = build_model(RESNET, seed=seed).train()
    with torch.no_grad():
        for step in range(3):
            model(randn(seed * 10 + step, 16, *RESNET.input_shape) * 2 + 0.5)
    return model.eval()


@pytest.mark.parametrize(("level", "piece"), [(0, 0), (1, 0), (1, 1), (2, 1)])
def test_block_statistics_of_two_sites_add_up_to_those_of_the_pooled_data(level, piece):
    """Stem conv+BN, a block's conv1+BN, conv2+BN with the identity stream, conv2 with the
    projection shortcut: every statistic of the union is the sum over the sites."""
    model, fused = _resnet(0), _resnet(1)
    request = StatisticsRequest(level, fused, dtype="float64", piece=piece)
    a, b = randn(1, 9, *RESNET.input_shape), randn(2, 6, *RESNET.input_shape)
    parts = [site_statistics(model, d, request, device="cpu") for d in (a, b)]
    pooled = site_statistics(model, torch.cat([a, b]), request, device="cpu")
    assert pooled.rows == parts[0].rows + parts[1].rows
    assert (pooled.stream_cross is not None) == ((level, piece) == (1, 1))
    for name in pooled.tensors():
        if name == "translation":
            continue  # each site's own fit: not a sum
        total = getattr(parts[0], name) + getattr(parts[1], name)
        # float32 products per batch (their rounding moves with the thread count), float64 sums
        torch.testing.assert_close(getattr(pooled, name), total, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", [HFSites, KFSites])
def test_a_resnet_fused_on_site_statistics_with_its_permuted_copy_keeps_its_function(method):
    model = _resnet(0)
    copy_ = permute_model(model, random_permutations(model, torch.Generator().manual_seed(3)))
    sites = LocalSites(
        [model, copy_],
        [randn(5, 48, *RESNET.input_shape), randn(6, 40, *RESNET.input_shape)],
        device="cpu",
    )
    result = method(use_scores=False).fuse([model, copy_], FusionInputs(sites=sites))
    fresh = randn(7, 32, *RESNET.input_shape)
    expected = model(fresh)
    # every piece is fitted exactly on the pooled rows: rounding and the GCV ridge remain
    assert (result.model.eval()(fresh) - expected).abs().max() < 1e-3 * expected.abs().max()
    pieces = [level.get("piece") for level in result.details["levels"]]
    assert pieces[:5] == ["conv", "conv1", "conv2", "conv1", "conv2+shortcut"]
    assert len(result.details["rounds"]) == len(pieces) == 10 and pieces[-1] is None


def test_a_broken_stream_statistic_of_a_block_is_named():
    models = [_resnet(s) for s in (0, 1)]
    data = [randn(8 + k, 24, *RESNET.input_shape) for k in range(2)]

    class BrokenStream(LocalSites):
        def gather(self, request):
            replies = super().gather(request)
            if replies[1].stream_norms is not None:
                replies[1].stream_norms = replies[1].stream_norms[:-1]
            return replies

    sites = BrokenStream(models, data, device="cpu")
    with pytest.raises(ValueError, match="site 1: statistic 'stream_norms' of level 1 piece 1"):
        KFSites(use_scores=False).fuse(models, FusionInputs(sites=sites))


# ------------------------------------------------------------------ ViT blocks, piece by piece
VIT = make_spec("vit", (1, 12, 12), 4, patch=4, depth=2, heads=2, hidden=8, mlp=12)


@pytest.mark.parametrize(
    ("level", "piece"), [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)], ids=str
)
def test_vit_statistics_of_two_sites_add_up_to_those_of_the_pooled_data(level, piece):
    """The embedding with its positions, queries and keys, values (with the stream), output,
    MLP: every statistic of the union is the sum over the sites."""
    model, fused = build_model(VIT, seed=0).eval(), build_model(VIT, seed=1).eval()
    request = StatisticsRequest(level, fused, dtype="float64", piece=piece)
    a, b = randn(1, 7, *VIT.input_shape), randn(2, 5, *VIT.input_shape)
    parts = [site_statistics(model, d, request, device="cpu") for d in (a, b)]
    pooled = site_statistics(model, torch.cat([a, b]), request, device="cpu")
    assert pooled.rows == parts[0].rows + parts[1].rows == 12 * 10  # 9 patches + class token
    assert (pooled.stream_cross is not None) == (piece in (1, 2, 4) and level == 1)
    for name in pooled.tensors():
        if name != "translation":
            total = getattr(parts[0], name) + getattr(parts[1], name)
            torch.testing.assert_close(getattr(pooled, name), total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", [HFSites, KFSites])
def test_a_vit_fused_on_site_statistics_with_its_permuted_copy_keeps_its_function(method):
    model = build_model(VIT, seed=0).eval()
    copy_ = permute_model(model, random_permutations(model, torch.Generator().manual_seed(3)))
    data = [randn(5, 48, *VIT.input_shape), randn(6, 40, *VIT.input_shape)]
    sites = LocalSites([model, copy_], data, device="cpu")
    result = method(use_scores=False).fuse([model, copy_], FusionInputs(sites=sites))
    fresh = randn(7, 32, *VIT.input_shape)
    expected = model(fresh)
    assert (result.model.eval()(fresh) - expected).abs().max() < 1e-3 * expected.abs().max()
    pieces = [level.get("piece") for level in result.details["levels"]]
    assert pieces[:6] == ["projection+position", "q+k", "v+out", "out", "fc1", "fc2"]
    assert len(result.details["rounds"]) == 12 and result.details["levels"][1]["heads"] == [
        0,
        1,
        0,
        1,
    ]


def test_a_resnet_fused_on_site_statistics_holds_the_pooled_batchnorm_statistics():
    """Each fitted BatchNorm's running statistics are its input's on the sites' pooled rows
    (read off the design's Gram), so the fused model trains on from the function it has."""
    models = [_resnet(0), _resnet(1)]
    data = [randn(5, 48, *RESNET.input_shape), randn(6, 40, *RESNET.input_shape)]
    sites = LocalSites(models, data, device="cpu")
    fused = KFSites(use_scores=False).fuse(models, FusionInputs(sites=sites)).model.eval()
    pooled = torch.cat(data)
    modules = dict(fused.named_modules())
    statistics = batchnorm_input_statistics(fused, pooled)
    assert len(statistics) == 12
    for name, (mean, var) in statistics.items():
        norm = modules[name]
        torch.testing.assert_close(norm.running_mean.double(), mean, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(norm.running_var.double(), var, atol=1e-4, rtol=1e-3)
    # a batch of those rows in train mode is normalised as in eval mode
    expected = fused(pooled)
    for module in fused.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.train()
    torch.testing.assert_close(fused(pooled), expected, atol=1e-3, rtol=1e-3)
