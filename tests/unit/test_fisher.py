"""Fisher merging and FedFisher (diagonal, K-FAC): what the sites compute equals its definition
computed sample by sample, and the server's merge solves its equations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.methods.averaging.fisher import solve_kfac_layer
from fedfuse.fusion.statistics.fisher import check_fisher, fisher_kinds, kfac_layers, site_fisher
from fedfuse.models import build_model, make_spec, mlp_spec

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ("fisher-merging", "fedfisher-diag", "fedfisher-kfac")


def _labels_drawn(model, inputs, batch_size, seed):
    """The labels :func:`site_fisher` draws (the same generator, the same order of draws)."""
    generator = torch.Generator().manual_seed(seed)
    labels = []
    with torch.no_grad():
        for batch in inputs.split(batch_size):
            probabilities = torch.softmax(model(batch).double(), dim=1)
            labels.append(torch.multinomial(probabilities, 1, generator=generator).squeeze(1))
    return torch.cat(labels)


def test_diagonal_fisher_is_the_mean_squared_per_sample_gradient():
    model = build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0).eval()
    inputs = torch.randn(20, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    fisher = site_fisher(
        model, inputs, ["diagonal"], samples=0, labels="sampled", seed=5, batch_size=8
    )
    labels = _labels_drawn(model, inputs, 8, 5)
    expected = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for x, y in zip(inputs, labels, strict=True):
        model.zero_grad()
        F.cross_entropy(model(x[None]), y[None]).backward()
        for name, parameter in model.named_parameters():
            expected[name] += parameter.grad.double() ** 2 / len(inputs)
    for name, value in expected.items():
        torch.testing.assert_close(fisher[f"diagonal.{name}"].double(), value, rtol=1e-4, atol=1e-9)


def test_kfac_factors_are_the_input_gram_and_the_summed_output_gradients():
    model = build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0).eval()
    inputs = torch.randn(20, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    fisher = site_fisher(model, inputs, ["kfac"], samples=0, labels="sampled", seed=5, batch_size=8)
    labels = _labels_drawn(model, inputs, 8, 5)
    first_name, first = next(iter(kfac_layers(model).items()))
    rows = torch.cat([inputs.reshape(20, -1), torch.ones(20, 1)], 1).double()
    torch.testing.assert_close(fisher[f"kfac.{first_name}.inputs"].double(), rows.T @ rows / 20)
    captured = {}
    first.register_forward_hook(lambda m, a, out: captured.update(out=out))
    outputs = torch.zeros(first.out_features, first.out_features, dtype=torch.float64)
    for x, y in zip(inputs, labels, strict=True):
        logits = model(x[None])
        (gradient,) = torch.autograd.grad(F.cross_entropy(logits, y[None]), captured["out"])
        g = gradient.double().reshape(1, -1)
        outputs += g.T @ g / 20
    torch.testing.assert_close(
        fisher[f"kfac.{first_name}.outputs"].double(), outputs, rtol=1e-4, atol=1e-10
    )


def _expected_by_hand(model, inputs, layer):
    """The diagonal Fisher and ``layer``'s K-FAC ``G`` as their definitions read, one row and
    one class at a time: ``sum_c p(c|x) (d log p(c|x))^2`` averaged over the rows."""
    diagonal = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    outputs = torch.zeros(layer.out_features, layer.out_features, dtype=torch.float64)
    captured = {}
    handle = layer.register_forward_hook(lambda m, a, out: captured.update(out=out))
    for x in inputs:
        probabilities = torch.softmax(model(x[None]).double(), dim=1)[0].detach()
        for c, p in enumerate(probabilities):
            model.zero_grad()
            loss = F.cross_entropy(model(x[None]), torch.tensor([c]))
            (gradient,) = torch.autograd.grad(loss, captured["out"], retain_graph=True)
            loss.backward()
            for name, parameter in model.named_parameters():
                diagonal[name] += p * parameter.grad.double() ** 2 / len(inputs)
            g = gradient.double().reshape(1, -1)
            outputs += p * g.T @ g / len(inputs)
    handle.remove()
    return diagonal, outputs


@pytest.mark.parametrize("labels", ["expected", "auto"])
def test_expected_fisher_is_the_probability_weighted_sum_over_classes(labels):
    model = build_model(mlp_spec((1, 4, 4), 3, (8, 6)), seed=0).eval()
    inputs = torch.randn(10, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    fisher = site_fisher(model, inputs, ["diagonal", "kfac"], labels=labels, batch_size=4)
    name, layer = list(kfac_layers(model).items())[-1]
    diagonal, outputs = _expected_by_hand(model, inputs, layer)
    for key, value in diagonal.items():
        torch.testing.assert_close(fisher[f"diagonal.{key}"].double(), value, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(
        fisher[f"kfac.{name}.outputs"].double(), outputs, rtol=1e-4, atol=1e-10
    )
    # the default takes every row (no subsample) and the same expectation
    default = site_fisher(model, inputs, ["diagonal"], batch_size=4)
    for key, value in default.items():
        torch.testing.assert_close(value, fisher[key])


def test_expected_fisher_of_a_linear_softmax_model_is_its_closed_form():
    """For logits ``W x`` the Fisher of ``W`` is ``E_x (diag(p) - p p^T) (x) x x^T``: its
    diagonal ``E_x p_c (1 - p_c) x_j^2``, with no sampled label (exact property)."""
    model = build_model(mlp_spec((1, 2, 2), 3, ()), seed=0).eval()
    inputs = torch.randn(7, 1, 2, 2, generator=torch.Generator().manual_seed(2))
    fisher = site_fisher(model, inputs, ["diagonal"], labels="expected")
    (weight_name, weight), (bias_name, _) = list(model.named_parameters())
    x = inputs.reshape(7, -1).double()
    p = torch.softmax(model(inputs).double(), dim=1).detach()
    closed = ((p * (1 - p)).T @ x.square() / 7).reshape(weight.shape)
    torch.testing.assert_close(
        fisher[f"diagonal.{weight_name}"].double(), closed, rtol=1e-5, atol=1e-9
    )
    torch.testing.assert_close(
        fisher[f"diagonal.{bias_name}"].double(), (p * (1 - p)).mean(0), rtol=1e-5, atol=1e-9
    )


def test_fisher_labels_are_checked():
    model = build_model(mlp_spec((1, 2, 2), 3, ()), seed=0)
    with pytest.raises(ValueError, match="labels"):
        site_fisher(model, torch.randn(3, 1, 2, 2), ["diagonal"], labels="empirical")


def test_convolution_factors_average_patches_over_positions():
    spec = make_spec("lenet5", (1, 28, 28), 10)
    model = build_model(spec, seed=0).eval()
    inputs = torch.randn(6, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    fisher = site_fisher(model, inputs, ["kfac"], samples=0)
    name, conv = next(iter(kfac_layers(model).items()))
    patches = F.unfold(inputs, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1]).double()
    rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=torch.float64)], 1)
    positions = patches.shape[-1]
    torch.testing.assert_close(
        fisher[f"kfac.{name}.inputs"].double(), rows.T @ rows / positions / 6, rtol=1e-5, atol=1e-7
    )
    check_fisher(model, fisher, ["kfac"], source="site 0")


@pytest.mark.parametrize("arch", ["resnet", "vit", "vgg11"])
def test_sites_compute_both_kinds_for_blocks_and_normalisations(arch):
    options = {
        "resnet": ((3, 16, 16), {"depth": 10, "width_multiplier": 0.125}),
        "vit": ((3, 16, 16), {"patch": 4, "depth": 1, "heads": 2, "hidden": 16, "mlp": 16}),
        "vgg11": ((3, 32, 32), {"width_multiplier": 1 / 16}),
    }[arch]
    model = build_model(make_spec(arch, options[0], 10, **options[1]), seed=0)
    fisher = site_fisher(model, torch.randn(12, *options[0]), ["diagonal", "kfac"])
    check_fisher(model, fisher, ["diagonal", "kfac"], source="site 0")
    assert all(bool((v.diagonal() >= 0).all()) for k, v in fisher.items() if k.startswith("kfac."))


def test_kfac_solve_matches_the_dense_kronecker_solution():
    generator = torch.Generator().manual_seed(0)

    def spd(n):
        m = torch.randn(n, 2 * n, generator=generator, dtype=torch.float64)
        return m @ m.T / n

    weights = [torch.randn(3, 5, generator=generator, dtype=torch.float64) for _ in range(3)]
    inputs, outputs, shares = (
        [spd(5) for _ in range(3)],
        [spd(3) for _ in range(3)],
        [0.5, 0.3, 0.2],
    )
    solved, steps = solve_kfac_layer(weights, inputs, outputs, shares, damping=0.0)
    # vec(G W A) = (A^T (x) G) vec(W), column-major vec; A is symmetric
    lhs = sum(p * torch.kron(a, g) for p, a, g in zip(shares, inputs, outputs, strict=True))
    rhs = sum(
        p * torch.kron(a, g) @ w.T.reshape(-1)
        for p, a, g, w in zip(shares, inputs, outputs, weights, strict=True)
    )
    dense = torch.linalg.solve(lhs, rhs).reshape(5, 3).T
    torch.testing.assert_close(solved, dense, rtol=1e-5, atol=1e-6)
    assert 0 < steps <= 15


def _two_shared_init_sites():
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    base = build_model(spec, seed=0)
    sites = []
    for seed in (1, 2):
        model = copy.deepcopy(base)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(
                    0.1
                    * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed))
                )
        sites.append(model)
    data = [
        torch.randn(30, 1, 4, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)
    ]
    fishers = [site_fisher(m, x, ["diagonal", "kfac"]) for m, x in zip(sites, data, strict=True)]
    return sites, fishers


@pytest.mark.parametrize("name", METHODS)
def test_identical_sites_give_back_the_site_model(name):
    sites, fishers = _two_shared_init_sites()
    fused = make_fusion_method(name, damping=1e-3).fuse(
        [sites[0], copy.deepcopy(sites[0])],
        FusionInputs(fisher=[fishers[0], fishers[1]], sample_counts=[3, 1]),
    )
    for key, value in sites[0].state_dict().items():
        torch.testing.assert_close(fused.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_diagonal_merge_is_the_fisher_weighted_average():
    sites, fishers = _two_shared_init_sites()
    fused = make_fusion_method("fedfisher-diag", damping=0.0).fuse(
        sites, FusionInputs(fisher=fishers, sample_counts=[3, 1])
    )
    for name, _ in sites[0].named_parameters():
        f0, f1 = (0.75 * fishers[0][f"diagonal.{name}"], 0.25 * fishers[1][f"diagonal.{name}"])
        w0, w1 = sites[0].state_dict()[name], sites[1].state_dict()[name]
        expected = torch.where(f0 + f1 > 0, (f0 * w0 + f1 * w1) / (f0 + f1), 0.75 * w0 + 0.25 * w1)
        torch.testing.assert_close(fused.model.state_dict()[name], expected, rtol=1e-4, atol=1e-6)


def test_kfac_merge_solves_each_layer_with_its_bias_as_the_last_column():
    sites, fishers = _two_shared_init_sites()
    fused = make_fusion_method("fedfisher-kfac", damping=1e-2).fuse(
        sites, FusionInputs(fisher=fishers, sample_counts=[3, 1])
    )
    for name in kfac_layers(sites[0]):
        states = [s.state_dict() for s in sites]
        matrices = [torch.cat([s[f"{name}.weight"], s[f"{name}.bias"][:, None]], 1) for s in states]
        solved, _ = solve_kfac_layer(
            matrices,
            [f[f"kfac.{name}.inputs"] for f in fishers],
            [f[f"kfac.{name}.outputs"] for f in fishers],
            [0.75, 0.25],
            1e-2,
        )
        merged = fused.model.state_dict()
        torch.testing.assert_close(merged[f"{name}.weight"], solved[:, :-1].float())
        torch.testing.assert_close(merged[f"{name}.bias"], solved[:, -1].float())
    assert not torch.equal(
        merged[f"{name}.weight"],
        0.75 * states[0][f"{name}.weight"] + 0.25 * states[1][f"{name}.weight"],
    )


def test_damping_auto_chooses_on_the_labelled_fusion_set():
    sites, fishers = _two_shared_init_sites()
    data = torch.randn(16, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(4))
    result = make_fusion_method("fisher-merging").fuse(
        sites, FusionInputs(data=data, labels=labels, fisher=fishers)
    )
    accuracies = result.details["fusion_set_accuracies"]
    assert list(accuracies)[0] == "0.01"  # the unlabelled value, preferred
    assert set(result.details["fusion_set_losses"]) == set(accuracies)
    # kept only if no value is more accurate by more than one paired standard error
    chosen = result.details["damping"]
    assert accuracies[str(chosen)] >= max(accuracies.values()) - 1 / 16**0.5
    explicit = make_fusion_method("fisher-merging", damping=chosen).fuse(
        sites, FusionInputs(fisher=fishers)
    )
    torch.testing.assert_close(explicit.model(data), result.model(data))


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda f: f.pop("kfac.levels.0.1.inputs"), "no 'kfac.levels.0.1.inputs'"),
        (lambda f: f.update({"kfac.levels.0.1.outputs": torch.eye(3)}), "has shape"),
        (lambda f: f["kfac.levels.0.1.outputs"].fill_(float("nan")), "NaN/Inf"),
    ],
)
def test_a_broken_fisher_upload_is_named_with_its_site(breakage, message):
    sites, fishers = _two_shared_init_sites()
    assert "kfac.levels.0.1.inputs" in fishers[1]
    breakage(fishers[1])
    with pytest.raises(ValueError, match=f"site 1.*{message}"):
        make_fusion_method("fedfisher-kfac", damping=0.1).fuse(
            sites, FusionInputs(fisher=fishers, sample_counts=[1, 1])
        )


def test_negative_diagonal_fisher_is_refused():
    sites, fishers = _two_shared_init_sites()
    fishers[0]["diagonal.levels.0.1.weight"][0, 0] = -1.0
    with pytest.raises(ValueError, match="site 0.*negative"):
        make_fusion_method("fisher-merging", damping=0.1).fuse(sites, FusionInputs(fisher=fishers))


def test_sites_upload_only_the_kinds_the_run_reads():
    kinds = fisher_kinds([make_fusion_method("fedfisher-kfac"), make_fusion_method("fedavg")])
    assert kinds == ("kfac",)
    assert fisher_kinds([make_fusion_method("regmean")]) == ()
    both = [make_fusion_method("fisher-merging"), make_fusion_method("fedfisher-kfac")]
    assert fisher_kinds(both) == ("diagonal", "kfac")


@pytest.mark.parametrize("labels", ["expected", "sampled"])
def test_layer_hooks_give_the_per_sample_diagonal_of_convolutions(labels):
    """The hook path (LeNet's convolutions and linear layers) equals ``torch.func``'s per-sample
    gradients squared, on the same labels."""
    from fedfuse.fusion.statistics import fisher as module

    model = build_model(make_spec("lenet5", (1, 28, 28), 10), seed=0).eval()
    inputs = torch.randn(6, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    fisher = site_fisher(model, inputs, ["diagonal"], labels=labels, batch_size=4)
    names = [n for n, _ in model.named_parameters()]
    draw = torch.Generator().manual_seed(0) if labels == "sampled" else None
    direct = module._vmap_diagonal(model, names, inputs, draw, 4, torch.device("cpu"))
    for name in names:
        torch.testing.assert_close(
            fisher[f"diagonal.{name}"].double(), direct[name] / 6, rtol=1e-4, atol=1e-10
        )
