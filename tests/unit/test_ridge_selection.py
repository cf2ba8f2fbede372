"""The ridge of the Linear variants is chosen from the fusion set: exact leave-one-out on the
kernel route, GCV on the gram route, each pinned against its definition or a brute force."""

import pytest
import torch

from fedfuse.fusion import FusionInputs, make_fusion_method
from fedfuse.fusion.blocks.least_squares import (
    RIDGE_GRID,
    gcv_scores,
    gram_basis,
    gram_spectrum,
    kernel_spectrum,
    loo_scores,
    weighted_least_squares,
)
from fedfuse.models import build_model, mlp_spec
from fedfuse.models.affine import affine_view


def _problem(rows: int, cols: int, k: int, *, signal: float, noise: float, seed: int):
    """Noisy linear targets of a design with decaying column scales (a few strong directions,
    as in trained networks) and a constant column (the bias), float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x *= 0.8 ** torch.arange(cols, dtype=torch.float64)
    x[:, -1] = 1.0
    beta = signal * torch.randn(cols, k, generator=g, dtype=torch.float64)
    t = x @ beta + noise * torch.randn(rows, k, generator=g, dtype=torch.float64)
    return x, t


def _brute_loo(x, t, penalty, column_weights):
    """Leave-one-out by refitting the ridge without each row (on the smaller side)."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        xk, tk = x[keep], t[keep]
        if len(xk) >= x.shape[1]:
            eye = torch.eye(x.shape[1], dtype=x.dtype)
            w = torch.linalg.solve(xk.T @ xk + penalty * eye, xk.T @ tk)
        else:
            eye = torch.eye(len(xk), dtype=x.dtype)
            w = xk.T @ torch.linalg.solve(xk @ xk.T + penalty * eye, tk)
        total += ((t[i] - x[i] @ w) ** 2 * column_weights).sum()
    return float(total) / len(x)


def _gcv_by_definition(x, t, penalty, column_weights):
    """``n ||(I - H) T||_w^2 / (n - tr H)^2`` with the hat matrix built explicitly (a
    pseudo-inverse: at ridge 0 a rank-deficient design gives the projection onto its columns)."""
    n, p = x.shape
    hat = x @ torch.linalg.pinv(x.T @ x + penalty * torch.eye(p, dtype=x.dtype)) @ x.T
    rss = float((((t - hat @ t) ** 2).sum(0) * column_weights).sum())
    return n * rss / (n - float(hat.trace())) ** 2


def test_the_grid_starts_at_zero_and_spans_half_decades_to_ten():
    assert RIDGE_GRID[0] == 0.0 and RIDGE_GRID[-1] == pytest.approx(10.0)
    steps = torch.tensor(RIDGE_GRID[1:]).log10().diff()
    assert torch.allclose(steps, torch.full_like(steps, 0.5))
    assert RIDGE_GRID[1] == pytest.approx(1e-6)


def test_closed_form_loo_equals_refitting_without_each_row():
    x, t = _problem(20, 30, 3, signal=1.0, noise=0.5, seed=0)  # fewer rows than columns
    weights = torch.tensor([1.0, 0.3, 2.0], dtype=torch.float64)
    spectrum = kernel_spectrum(x)
    choice = spectrum.select_ridge(t, column_weights=weights)
    assert choice.criterion == "loo" and choice.grid == RIDGE_GRID
    jitter = 1e-10 * float((x**2).sum(1).mean())  # kernel_spectrum's, as kernel_basis's
    brute = [_brute_loo(x, t, r * spectrum.scale + jitter, weights) for r in RIDGE_GRID]
    torch.testing.assert_close(
        torch.tensor(choice.scores, dtype=torch.float64),
        torch.tensor(brute, dtype=torch.float64),
        rtol=1e-9,
        atol=0,
    )
    best = RIDGE_GRID[min(range(len(brute)), key=brute.__getitem__)]
    assert choice.ridge == best
    assert 0 < choice.ridge < RIDGE_GRID[-1], "the test needs an interior optimum"
    assert choice.penalty == pytest.approx(choice.ridge * float((x**2).sum()) / x.shape[1])


def test_gcv_equals_its_definition_with_unprojected_targets():
    x, t = _problem(40, 6, 3, signal=0.5, noise=1.0, seed=1)
    weights = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    spectrum = gram_spectrum(x.T @ x, rows=len(x))
    coordinates = spectrum.coordinates(xtz=x.T @ t)
    scores = gcv_scores(
        spectrum.values,
        coordinates,
        (t**2).sum(0),
        len(x),
        [r * spectrum.scale for r in RIDGE_GRID],
        weights,
    )
    expected = [_gcv_by_definition(x, t, r * spectrum.scale, weights) for r in RIDGE_GRID]
    torch.testing.assert_close(
        scores, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0
    )
    # with projected targets (their norms equal the coordinates') the exact fit looks perfect
    projected = gcv_scores(spectrum.values, coordinates, (coordinates**2).sum(0), len(x), [0.0])
    assert float(projected[0]) == pytest.approx(0.0, abs=1e-9)
    assert float(scores[0]) > 0.1


def test_gcv_chooses_as_brute_force_leave_one_out_when_rows_far_exceed_columns():
    x, t = _problem(150, 5, 2, signal=0.05, noise=1.0, seed=2)
    spectrum = gram_spectrum(x.T @ x, rows=len(x))
    choice = spectrum.select_ridge(spectrum.coordinates(xtz=x.T @ t), target_norms=(t**2).sum(0))
    assert choice.criterion == "gcv"
    ones = torch.ones(2, dtype=torch.float64)
    brute = [_brute_loo(x, t, r * spectrum.scale, ones) for r in RIDGE_GRID]
    best = RIDGE_GRID[min(range(len(brute)), key=brute.__getitem__)]
    assert choice.ridge == best
    assert 0 < choice.ridge < RIDGE_GRID[-1], "the test needs an interior optimum"
    # with n >> p, GCV approximates leave-one-out along the whole grid
    torch.testing.assert_close(
        torch.tensor(choice.scores, dtype=torch.float64),
        torch.tensor(brute, dtype=torch.float64),
        rtol=0.05,
        atol=0,
    )


@pytest.mark.parametrize("route", ["loo", "gcv"])
def test_column_weights_weigh_each_column_criterion(route):
    rows, cols = (15, 25) if route == "loo" else (60, 8)
    x, t = _problem(rows, cols, 2, signal=0.3, noise=1.0, seed=3)
    t[:, 1] = x @ torch.linspace(-1, 1, cols, dtype=x.dtype) * 3  # a noiseless column
    if route == "loo":
        spectrum = kernel_spectrum(x)
        penalties = [r * spectrum.scale for r in RIDGE_GRID]

        def scores(targets, weights=None):
            return loo_scores(spectrum.values, spectrum.vectors, targets, penalties, weights)

        def choose(targets, weights):
            return spectrum.select_ridge(targets, column_weights=weights)
    else:
        spectrum = gram_spectrum(x.T @ x, rows=rows)
        penalties = [r * spectrum.scale for r in RIDGE_GRID]

        def scores(targets, weights=None):
            u = spectrum.coordinates(xtz=x.T @ targets)
            norms = (targets**2).sum(0)
            return gcv_scores(spectrum.values, u, norms, rows, penalties, weights)

        def choose(targets, weights):
            u = spectrum.coordinates(xtz=x.T @ targets)
            return spectrum.select_ridge(
                u, target_norms=(targets**2).sum(0), column_weights=weights
            )

    weights = torch.tensor([0.25, 4.0], dtype=torch.float64)
    weighted = scores(t, weights)
    parts = 0.25 * scores(t[:, :1]) + 4.0 * scores(t[:, 1:])
    torch.testing.assert_close(weighted, parts, rtol=1e-10, atol=0)
    # a column of weight 0 does not move the choice; each column alone wants another ridge
    noisy, clean = choose(t, torch.tensor([1.0, 0.0])), choose(t, torch.tensor([0.0, 1.0]))
    assert noisy.ridge == choose(t[:, :1], None).ridge
    assert clean.ridge == choose(t[:, 1:], None).ridge
    assert noisy.ridge > clean.ridge
    with pytest.raises(ValueError, match="column_weights has 3 entries for 2 target columns"):
        scores(t, torch.ones(3))


@pytest.mark.parametrize("route", ["kernel", "gram"])
def test_the_fit_at_the_chosen_ridge_is_the_direct_ridge_solve(route):
    rows, cols = (18, 30) if route == "kernel" else (80, 10)
    x, t = _problem(rows, cols, 4, signal=0.2, noise=1.0, seed=4)
    if route == "kernel":
        spectrum = kernel_spectrum(x)
        targets, norms = t, None
    else:
        spectrum = gram_spectrum(x.T @ x, rows=rows)
        targets, norms = spectrum.coordinates(xtz=x.T @ t), (t**2).sum(0)
    choice = spectrum.select_ridge(targets, target_norms=norms)
    assert choice.ridge > 0, "the test needs a ridge"
    direct = weighted_least_squares(x, t, ridge=choice.penalty)
    torch.testing.assert_close(
        spectrum.weights(targets, choice.ridge), direct, rtol=1e-8, atol=1e-10
    )
    if route == "gram":  # the same relative convention as the fixed-ridge basis
        basis = gram_basis(x.T @ x, ridge=choice.ridge)
        fixed = basis.weights(basis.coordinates(xtz=x.T @ t))
        torch.testing.assert_close(
            spectrum.weights(targets, choice.ridge), fixed, rtol=1e-8, atol=1e-10
        )


def test_dead_input_columns_get_weight_zero_and_do_not_move_the_choice():
    x, t = _problem(60, 6, 2, signal=0.3, noise=1.0, seed=6)
    dead = torch.cat([x[:, :2], torch.zeros(60, 1, dtype=x.dtype), x[:, 2:]], 1)
    choices, fits = [], []
    for design in (x, dead):
        spectrum = gram_spectrum(design.T @ design, rows=60)
        u = spectrum.coordinates(xtz=design.T @ t)
        # the same relative ridge is the same penalty only with the same mean eigenvalue
        spectrum.scale = float((x**2).sum()) / 6
        choices.append(spectrum.select_ridge(u, target_norms=(t**2).sum(0)))
        fits.append(spectrum.weights(u, choices[-1].ridge))
    assert choices[0].ridge == choices[1].ridge and choices[0].ridge > 0
    torch.testing.assert_close(torch.tensor(choices[0].scores), torch.tensor(choices[1].scores))
    assert torch.equal(fits[1][2], torch.zeros(2, dtype=x.dtype))
    torch.testing.assert_close(torch.cat([fits[1][:2], fits[1][3:]]), fits[0])


def test_a_failed_eigendecomposition_is_retried_with_a_jitter(monkeypatch):
    x, t = _problem(50, 5, 2, signal=0.3, noise=1.0, seed=7)
    reference = gram_spectrum(x.T @ x, rows=50)
    eigh, calls = torch.linalg.eigh, []

    def failing_once(matrix):
        calls.append(matrix)
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("the algorithm failed to converge")
        return eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", failing_once)
    spectrum = gram_spectrum(x.T @ x, rows=50)
    assert len(calls) == 2
    torch.testing.assert_close(spectrum.values, reference.values, rtol=1e-9, atol=0)
    u = spectrum.coordinates(xtz=x.T @ t)
    torch.testing.assert_close(
        spectrum.weights(u, 0.1), reference.weights(reference.coordinates(xtz=x.T @ t), 0.1)
    )


def test_gram_spectrum_needs_the_unprojected_norms_and_refuses_nan():
    x, t = _problem(30, 4, 1, signal=1.0, noise=0.1, seed=5)
    spectrum = gram_spectrum(x.T @ x, rows=30)
    with pytest.raises(ValueError, match="target_norms"):
        spectrum.select_ridge(spectrum.coordinates(xtz=x.T @ t))
    bad = x.T @ x
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gram_spectrum(bad, rows=30)


def test_kf_linear_records_the_ridge_it_chose_per_level_and_fits_with_it():
    spec = mlp_spec((1, 4, 4), 3, (8, 6))
    models = [build_model(spec, seed=s).eval() for s in (0, 1)]
    data = torch.randn(12, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    result = make_fusion_method("kf-linear", device="cpu").fuse(models, FusionInputs(data=data))
    levels = result.details["levels"]
    assert result.details["ridge_grid"] == list(RIDGE_GRID)
    # fan-ins 17, 9, 7 against 12 rows: the first level is under-determined
    assert [lv["route"] for lv in levels] == ["kernel", "gram", "gram"]
    assert [lv["ridge_criterion"] for lv in levels] == ["loo", "gcv", "gcv"]
    for lv in levels:
        scores = lv["ridge_scores"]
        assert len(scores) == len(RIDGE_GRID) and lv["ridge"] in RIDGE_GRID
        finite = [s for s in scores if s is not None]
        assert scores[RIDGE_GRID.index(lv["ridge"])] == min(finite)
    # the head (targets: the mean of the base logits) is the direct ridge fit at that ridge
    fused = result.model
    x = data
    with torch.no_grad():
        for level in fused.levels[:-1]:
            x = level(x)
        logits = torch.stack([m(data) for m in models]).mean(0).double()
    view = affine_view(fused.levels[-1])
    design = view.design(x).double()
    penalty = levels[-1]["ridge"] * float((design**2).sum()) / view.fan_in
    expected = weighted_least_squares(design, logits, ridge=penalty)
    torch.testing.assert_close(view.weights().double(), expected, rtol=1e-4, atol=1e-5)
    # ... at the ridge of least GCV of the real (unprojected) targets, each class weighing 1
    scale = float((design**2).sum()) / view.fan_in
    ones = torch.ones(3, dtype=torch.float64)
    gcv = [_gcv_by_definition(design, logits, r * scale, ones) for r in RIDGE_GRID]
    torch.testing.assert_close(
        torch.tensor(levels[-1]["ridge_scores"], dtype=torch.float64),
        torch.tensor(gcv, dtype=torch.float64),
        rtol=1e-4,
        atol=0,
    )
    # a number is a fixed ridge on every level
    fixed = make_fusion_method("kf-linear", ridge=0.01, device="cpu").fuse(
        models, FusionInputs(data=data)
    )
    assert [lv["ridge_criterion"] for lv in fixed.details["levels"]] == ["fixed"] * 3
    assert [lv["ridge"] for lv in fixed.details["levels"]] == [0.01] * 3
    assert "ridge_grid" not in fixed.details
