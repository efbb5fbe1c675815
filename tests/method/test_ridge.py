"""The closed-form fit and its held-out error against direct computation on explicit matrices; a held-out error or
a map that is not finite is an error."""

import math

import pytest
import torch

from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import SplitStats
from ridgefill.method.ridge import LAMBDA_GRID, fit_split

H, LAYERS, SPLIT = 8, 5, 2  # two maps: layers 3 and 4


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g, dtype=torch.float64) * torch.linspace(0.5, 3, H, dtype=torch.float64)
    maps = [torch.eye(H, dtype=torch.float64) + 0.3 * torch.randn(H, H, generator=torch.Generator().manual_seed(9 + i),
                                                                  dtype=torch.float64) for i in range(2)]
    ys = [x @ m + 0.5 + 0.1 * torch.randn(n, H, generator=g, dtype=torch.float64) for m in maps]
    return x, ys


def stats_of(x, ys):
    st = SplitStats.empty(SPLIT, LAYERS, H)
    for lo in range(0, len(x), 37):  # streamed in uneven batches
        st.add_x(x[lo:lo + 37])
        for i, y in enumerate(ys):
            st.add_y(i, x[lo:lo + 37], y[lo:lo + 37])
    return st


def direct_fit(x, y, lam_abs):
    mx, my = x.mean(0), y.mean(0)
    xc, dc = x - mx, (y - x) - (my - mx)
    w = torch.eye(H, dtype=torch.float64) + torch.linalg.solve(xc.T @ xc + lam_abs * torch.eye(H, dtype=torch.float64),
                                                               xc.T @ dc)
    return w, my - mx @ w


def rel_err(x, y, w, b):
    return float(((x @ w + b - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())


@pytest.mark.parametrize("lam", [1e-4, 0.5])
def test_fit_matches_direct_solution_and_heldout_error(lam):
    x, ys = make_data(400, 0)
    xv, yvs = make_data(150, 1)
    fits = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=lam)
    xc = x - x.mean(0)
    lam_abs = lam * float(torch.trace(xc.T @ xc)) / H
    for fit, y, yv in zip(fits, ys, yvs):
        w, b = direct_fit(x, y, lam_abs)
        assert torch.allclose(fit.weight, w, atol=1e-9)
        assert torch.allclose(fit.bias, b, atol=1e-9)
        assert math.isclose(fit.error_map, rel_err(xv, yv, w, b), rel_tol=1e-9)
        assert math.isclose(fit.error_full_rank, fit.error_map, rel_tol=1e-9)
        eye = torch.eye(H, dtype=torch.float64)
        assert math.isclose(fit.error_identity, rel_err(xv, yv, eye, torch.zeros(H, dtype=torch.float64)), rel_tol=1e-9)
        assert fit.error_map < fit.error_identity


def test_auto_lambda_picks_the_grid_minimum():
    x, ys = make_data(60, 2)  # few rows: regularisation matters
    xv, yvs = make_data(200, 3)
    auto = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam="auto")
    for index, fit in enumerate(auto):
        errors = [fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=g)[index].error_map for g in LAMBDA_GRID]
        assert fit.lam in LAMBDA_GRID
        assert math.isclose(fit.error_map, min(errors), rel_tol=1e-9)


def test_large_lambda_tends_to_identity_plus_offset():
    x, ys = make_data(300, 4)
    fit = fit_split(stats_of(x, ys), None, lam=1e9)[0]
    assert torch.allclose(fit.weight, torch.eye(H, dtype=torch.float64), atol=1e-6)


def test_low_rank_is_a_truncated_residual():
    x, ys = make_data(300, 5)
    xv, yvs = make_data(100, 6)
    full = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=1e-3)[0]
    low = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=1e-3, rank=3)[0]
    u, v = low.low_rank
    assert u.shape == (H, 3) and v.shape == (3, H)
    assert torch.linalg.matrix_rank(full.weight - torch.eye(H, dtype=torch.float64)) == H
    assert low.error_map >= full.error_map - 1e-12
    assert math.isclose(low.error_full_rank, full.error_map, rel_tol=1e-9)


def test_input_basis_low_rank_keeps_most_of_the_fitted_predictions():
    """Reduced-rank ridge: among rank-r residual maps, the `inputs` basis loses the least of the full map's
    predictions on the calibration inputs, tr(ΔᵀPΔ) with P = Pxx + λI (Eckart–Young in that norm), so it beats
    the plain SVD of the residual on inputs as anisotropic as make_data's."""
    x, ys = make_data(300, 5)
    xv, yvs = make_data(100, 6)
    full = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=1e-3)[0]
    xc = x - x.mean(0)
    pxx = xc.T @ xc
    p = pxx + 1e-3 * float(torch.linalg.eigvalsh(pxx).clamp_min(0).mean()) * torch.eye(H, dtype=torch.float64)
    w_res = full.weight - torch.eye(H, dtype=torch.float64)
    lost = {}
    for basis in ("weights", "inputs"):
        u, v = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=1e-3, rank=3, rank_basis=basis)[0].low_rank
        assert u.shape == (H, 3) and v.shape == (3, H) and torch.linalg.matrix_rank(u @ v) == 3
        delta = w_res - u @ v
        lost[basis] = float(torch.trace(delta.T @ p @ delta))
    assert lost["inputs"] < 0.9 * lost["weights"]


def test_auto_without_heldout_is_refused():
    x, ys = make_data(50, 7)
    with pytest.raises(ValueError):
        fit_split(stats_of(x, ys), None, lam="auto")


def test_auto_lambda_is_chosen_on_validation_and_reported_on_test():
    x, ys = make_data(60, 2)
    xv, yvs = make_data(200, 3)
    xt, yts = make_data(150, 8)
    train, val, test = stats_of(x, ys), stats_of(xv, yvs), stats_of(xt, yts)
    on_val = fit_split(train, val, lam="auto")
    on_test = fit_split(train, val, lam="auto", test=test)
    for chosen, reported, y, yt in zip(on_val, on_test, ys, yts):
        assert reported.lam == chosen.lam  # the test rows choose nothing
        assert torch.allclose(reported.weight, chosen.weight)
        assert math.isclose(reported.error_map, rel_err(xt, yt, reported.weight, reported.bias), rel_tol=1e-9)
        eye, zero = torch.eye(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
        assert math.isclose(reported.error_identity, rel_err(xt, yt, eye, zero), rel_tol=1e-9)
        assert math.isclose(reported.error_full_rank, reported.error_map, rel_tol=1e-9)
        assert not math.isclose(reported.error_map, chosen.error_map, rel_tol=1e-6)


def normalized_stats_of(x, ys):
    st = SplitStats.empty(SPLIT, LAYERS, H, normalized=True)
    st.add_x(x)
    for i, y in enumerate(ys):
        st.add_y(i, x, y)
    return st


def test_normalized_targets_do_not_see_a_rows_scale():
    """The normalised-target sums are those of y / rms(y) per row: rescaling any row of y changes the raw sums
    and not these; and the normalised fit equals a raw fit on explicitly normalised (and rescaled) targets."""
    x, ys = make_data(300, 0)
    c = torch.rand(300, 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3 + 0.2
    a, b = normalized_stats_of(x, ys), normalized_stats_of(x, [y * c for y in ys])
    assert not torch.allclose(a.xty, b.xty)
    for name in ("xtyn", "ysumn", "yyn"):
        assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-10), name
    assert torch.allclose(a.yyn, torch.full((2,), 300.0 * H, dtype=torch.float64))  # every row has rms 1
    scale = torch.tensor([2.0, 3.0], dtype=torch.float64)
    targets = [y / y.square().mean(-1, keepdim=True).sqrt() * s for y, s in zip(ys, scale)]
    direct = stats_of(x, targets)
    fits = fit_split(a.normalized_targets(scale), None, lam=1e-3)
    for fit, ref in zip(fits, fit_split(direct, None, lam=1e-3)):
        assert torch.allclose(fit.weight, ref.weight, atol=1e-9) and torch.allclose(fit.bias, ref.bias, atol=1e-9)


def test_statistics_without_normalized_targets_stay_as_they_were():
    st = SplitStats.empty(SPLIT, LAYERS, H)
    assert not st.has_normalized and len(st.sums()) == 6
    assert set(st.tensors("p")) == {f"p.{n}" for n in ("xtx", "xsum", "xty", "ysum", "yy", "xx", "counts")}
    with pytest.raises(ValueError):
        st.normalized_targets(torch.ones(2, dtype=torch.float64))


def test_lookback_fit_matches_direct_solution_with_the_identity_on_x():
    """Inputs [x_t, x_{t-1}] ([n, 2H]) and targets that depend on both: the fit equals the direct ridge solution of
    the residual y − x_t with E = [I; 0], and identity fill's error is the same as with x_t alone."""
    x, _ = make_data(400, 0)
    prev = torch.roll(x, 1, 0)
    f = torch.cat([x, prev], 1)  # [n, 2H]
    g = torch.Generator().manual_seed(5)
    mats = [0.5 * torch.randn(H, H, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [x + prev @ m + 0.2 for m in mats]
    xv, _ = make_data(150, 1)
    fv = torch.cat([xv, torch.roll(xv, 1, 0)], 1)
    yvs = [xv + torch.roll(xv, 1, 0) @ m + 0.2 for m in mats]
    lam = 1e-3
    train, val = SplitStats.empty(SPLIT, LAYERS, H, lookback=1), SplitStats.empty(SPLIT, LAYERS, H, lookback=1)
    for st, inputs, targets in ((train, f, ys), (val, fv, yvs)):
        st.add_x(inputs)
        for i, y in enumerate(targets):
            st.add_y(i, inputs, y)
    fits = fit_split(train, val, lam=lam)
    plain = fit_split(stats_of(x, ys), stats_of(xv, yvs), lam=lam)
    fc = f - f.mean(0)
    lam_abs = lam * float(torch.trace(fc.T @ fc)) / (2 * H)
    eye = torch.eye(2 * H, H, dtype=torch.float64)
    for fit, y, yv, base in zip(fits, ys, yvs, plain):
        d = (y - x) - (y - x).mean(0)
        w = eye + torch.linalg.solve(fc.T @ fc + lam_abs * torch.eye(2 * H, dtype=torch.float64), fc.T @ d)
        assert fit.weight.shape == (2 * H, H)
        assert torch.allclose(fit.weight, w, atol=1e-8)
        assert torch.allclose(fit.bias, y.mean(0) - f.mean(0) @ w, atol=1e-8)
        assert math.isclose(fit.error_map, rel_err(fv, yv, fit.weight, fit.bias), rel_tol=1e-6)
        assert math.isclose(fit.error_identity, base.error_identity, rel_tol=1e-9)
        assert fit.error_map < base.error_map  # the targets read x_{t-1}: only the lookback map can see it


def test_lookback_low_rank_keeps_the_input_width():
    x, ys = make_data(300, 0)
    f = torch.cat([x, torch.roll(x, 1, 0)], 1)
    st = SplitStats.empty(SPLIT, LAYERS, H, lookback=1)
    st.add_x(f)
    for i, y in enumerate(ys):
        st.add_y(i, f, y)
    for basis in ("inputs", "weights"):
        u, v = fit_split(st, None, lam=1e-3, rank=3, rank_basis=basis)[0].low_rank
        assert u.shape == (2 * H, 3) and v.shape == (3, H)


@pytest.mark.parametrize("name, value", [("yy", math.nan), ("xty", math.inf), ("xsum", -math.inf)])
def test_a_nonfinite_heldout_error_is_an_error_not_a_choice(name, value):
    """One NaN or infinity in the validation statistics makes every λ's held-out error non-finite: refused, where
    counting it as the worst error chose the least-regularised λ."""
    x, ys = make_data(60, 2)
    xv, yvs = make_data(200, 3)
    val = stats_of(xv, yvs)
    getattr(val, name).view(-1)[-1] = value  # the last value: layer 4's (yy, xty), or x's
    layer = 4 if name != "xsum" else 3
    with pytest.raises(RidgefillError, match=rf"held-out error of layer {layer}'s map at λ 1e-07 is (nan|-?inf)"):
        fit_split(stats_of(x, ys), val, lam="auto")


@pytest.mark.parametrize("rank", [None, 3])
def test_a_map_that_comes_out_nonfinite_is_refused(rank):
    x, ys = make_data(300, 4)
    train = stats_of(x, ys)
    train.xty[1, 0, 0] = math.inf  # layer 4's map
    with pytest.raises(RidgefillError, match="fitted map of layer 4 .* has a NaN or an infinity in its weight"):
        fit_split(train, None, lam=1e-3, rank=rank)
