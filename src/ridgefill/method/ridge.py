"""Closed-form ridge maps from calibration statistics, shrinking toward the identity.

For split S and late layer l the map predicts Y_l from X as  Ŷ = X + (X − x̄) W_res + (ȳ − x̄),
i.e. W = I + W_res, b = ȳ − x̄ W, where W_res regresses the centred residual D = Y − X on the centred X:

    W_res(λ) = (Pxx + λ I)⁻¹ Pxd,   Pxx = Σ(x−x̄)(x−x̄)ᵀ,  Pxd = Σ(x−x̄)(d−d̄)ᵀ.

With lookback K (method/statistics.py) x is the row's map input [x_t, x_{t-1}, .., x_{t-K}] of width F = (K+1)·H
and the identity is E = [I; 0] [F, H] (x_t's block): Ŷ = x_t + (X − x̄) W_res + (ȳ − x̄_t), the residual
D = Y − x_t, and Pxd = Pxy − Pxx E. Everything below holds with E in place of I.

A large λ gives identity fill (plus the mean offset). λ is given relative to the mean eigenvalue of Pxx
(trace / H), so one value means the same on every model. With Pxx = Q diag(e) Qᵀ computed once per split,
W_res(λ) = Q diag(1/(e+λ)) QᵀPxd for every λ, and the held-out error of the whole λ grid comes from a few
precomputed H×H products (no refit per λ; see `_HeldOut`). `--lam auto` chooses λ on the validation rows
and the errors are reported on the test rows, which chose nothing (held-out sequences alternate between them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import SplitStats, first_nonfinite

LAMBDA_GRID = tuple(10.0**k for k in range(-7, 2))  # relative to trace(Pxx)/H


@dataclass
class LayerFit:
    layer: int
    lam: float  # relative λ
    weight: torch.Tensor | None  # [H, H] float64 (W = I + W_res), None when low rank
    bias: torch.Tensor  # [H]
    low_rank: tuple[torch.Tensor, torch.Tensor] | None  # U [H, r], V [r, H] with W = I + U V
    error_identity: float  # held-out ‖Ŷ−Y‖²/‖Y−Ȳ‖² of identity fill (x itself)
    error_map: float  # the same for this map
    error_full_rank: float  # the full-rank map at the same λ (equals error_map without --rank)


def _centred(st: SplitStats):
    n = st.count
    mx = st.xsum / n
    my = st.ysum / n  # [M, H]
    pxx = st.xtx - n * torch.outer(mx, mx)
    pxy = st.xty - n * mx[None, :, None] * my[:, None, :]  # [M, H, H]
    return mx, my, pxx, pxy


class _HeldOut:
    """Held-out SSE of W = I + Q diag(d) A for any d, from validation statistics shifted by the train means.

    With P = Σ(x−mx)(x−mx)ᵀ, R = Σ(x−mx)(y−my)ᵀ, T = Σ‖y−my‖² over the validation rows:
      SSE = T − 2 tr(WᵀR) + tr(WᵀPW)
          = T − 2 (tr R + d·u) + tr P + 2 d·w + dᵀ (M∘G) d
    where u = diag(QᵀRAᵀ), w = diag(APQ), M = QᵀPQ, G = AAᵀ.
    """

    def __init__(self, val: SplitStats, index: int, mx, my, q, a):
        """mx [H], my [H]: the train means of x and of this layer's y."""
        n = val.count
        sx, sy = val.xsum, val.ysum[index]
        p = val.xtx - torch.outer(mx, sx) - torch.outer(sx, mx) + n * torch.outer(mx, mx)
        r = val.xty[index] - torch.outer(mx, sy) - torch.outer(sx, my) + n * torch.outer(mx, my)
        self.t = float(val.yy[index] - 2 * my @ sy + n * my @ my)
        self.denominator = float(val.yy[index] - sy @ sy / n)
        self.p, self.r = p, r
        hidden = r.shape[1]
        self.tr_r, self.tr_p = float(torch.trace(r)), float(torch.trace(p[:hidden, :hidden]))  # tr(EᵀR), tr(EᵀPE)
        self.u = ((q.T @ r) * a).sum(1)  # diag(QᵀR Aᵀ)
        self.w = ((a @ p[:hidden]) * q.T).sum(1)  # diag(A EᵀP Q)
        self.mg = (q.T @ p @ q) * (a @ a.T)
        self.identity_sse = identity_sse(val, index)

    def sse(self, d: torch.Tensor) -> float:
        return float(self.t - 2 * (self.tr_r + d @ self.u) + self.tr_p + 2 * d @ self.w + d @ self.mg @ d)

    def sse_of(self, w: torch.Tensor) -> float:
        """Held-out SSE of an explicit W (bias b = ȳ − x̄W)."""
        return self.t - 2 * float(torch.sum(w * self.r)) + float(torch.sum(w * (self.p @ w)))

    def relative(self, sse: float) -> float:
        return sse / self.denominator if self.denominator > 0 else math.nan


def identity_sse(val: SplitStats, index: int) -> float:
    """Held-out SSE of identity fill (W = E, b = 0) of late layer `index`, from the raw sums."""
    return float(val.yy[index] - 2 * torch.trace(val.xty[index]) + val.xx)  # tr: x_t's block


def mean_split(train: SplitStats, report: SplitStats | None) -> list[LayerFit]:
    """The `mean` control's maps for one split: zero weights, each bias the train mean of its layer's input (the
    map ignores the row). Errors on `report` (None or empty: NaN), beside identity fill's."""
    my = train.ysum / train.count  # [M, H]
    fits = []
    for index in range(my.shape[0]):
        err_id = err_mean = math.nan
        if report is not None and report.count > 0:
            n, sy, yy = report.count, report.ysum[index], report.yy[index]
            denominator = float(yy - sy @ sy / n)  # Σ‖y − ȳ‖² over the report rows
            if denominator > 0:
                err_mean = float(yy - 2 * my[index] @ sy + n * my[index] @ my[index]) / denominator
                err_id = identity_sse(report, index) / denominator
        fits.append(LayerFit(train.split + 1 + index, math.nan, None, my[index], None, err_id, err_mean, err_mean))
    return fits


RANK_BASES = ("inputs", "weights")  # the first is the default (docs/quality.md, "Low rank")


def fit_split(train: SplitStats, val: SplitStats | None, lam: float | str = "auto",
              rank: int | None = None, progress=None, test: SplitStats | None = None,
              rank_basis: str = RANK_BASES[0]) -> list[LayerFit]:
    """Fit every late layer's map for one split. lam: a relative λ, or 'auto' (pick per layer by the error on
    `val` over LAMBDA_GRID). rank: keep r directions of W_res, chosen by `rank_basis` (`low_rank`). The errors
    reported are measured on `test` when it has rows (rows that chose nothing), else on `val`."""
    has_val = val is not None and val.count > 0
    if lam == "auto" and not has_val:
        raise ValueError("lam='auto' needs held-out statistics")
    report = test if test is not None and test.count > 0 else (val if has_val else None)
    mx, my, pxx, pxy = _centred(train)
    features, hidden = pxy.shape[1:]  # F = (K+1)·H map inputs, H outputs
    e, q = torch.linalg.eigh(pxx)
    e = e.clamp_min(0)
    scale = float(e.mean()) or 1.0
    eye = torch.eye(features, hidden, dtype=pxx.dtype, device=pxx.device)  # E: x_t's block
    grid = LAMBDA_GRID if lam == "auto" else (float(lam),)
    fits = []
    for index in range(pxy.shape[0]):
        a = q.T @ (pxy[index] - pxx[:, :hidden])  # Qᵀ Pxd  [F, H]
        held = _HeldOut(report, index, mx, my[index], q, a) if report is not None else None  # errors reported
        if lam != "auto" or report is val:  # the rows λ is chosen on (none for a given λ)
            chooser = held
        else:
            chooser = _HeldOut(val, index, mx, my[index], q, a)
        layer = train.split + 1 + index
        chosen = grid[_best(chooser, e, scale, grid, layer)] if chooser is not None else grid[0]
        d = 1.0 / (e + chosen * scale)  # [H]  W_res = Q diag(d) A
        w_res = q @ (a * d[:, None])
        _check_finite(layer, chosen, {"weight": w_res})
        low = None
        if rank is not None and rank < min(features, hidden):
            low = low_rank(w_res, rank, rank_basis, q, e + chosen * scale)
            w_res = low[0] @ low[1]
        w = eye + w_res
        bias = my[index] - mx @ w
        _check_finite(layer, chosen, {"bias": bias, **({"u": low[0], "v": low[1]} if low else {})})
        err_map = held.relative(held.sse_of(w)) if held else math.nan
        err_full = held.relative(held.sse(d)) if held else math.nan
        err_id = held.relative(held.identity_sse) if held else math.nan
        fits.append(LayerFit(layer, chosen, None if low else w, bias, low, err_id, err_map,
                             err_full))
        if progress is not None:
            progress()
    return fits


def _best(held: _HeldOut, e: torch.Tensor, scale: float, grid, layer: int) -> int:
    """Index of the λ in `grid` with the least error on the held-out rows of `held`. An error that is not finite
    is refused: it cannot be compared, so it must not decide (nor lose) the choice."""
    errors = torch.tensor([held.sse(1.0 / (e + g * scale)) for g in grid])  # [len(grid)] float64
    bad = (~errors.isfinite()).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RidgefillError(f"the held-out error of layer {layer}'s map at λ {grid[i]:g} is {float(errors[i])}: the "
                             "held-out statistics are not usable; recalibrate (in fp32)")
    return int(errors.argmin())


def _check_finite(layer: int, lam: float, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a map that came out with a NaN or an infinity (before anything is written)."""
    name = first_nonfinite(tensors)
    if name:
        raise RidgefillError(f"the fitted map of layer {layer} (λ {lam:g}) has a NaN or an infinity in its {name}: "
                             "nothing was written; fit with a larger --lam, or recalibrate in fp32")


def low_rank(w_res: torch.Tensor, rank: int, basis: str, q: torch.Tensor,
             e_reg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-r W_res [F, H] = U V (U [F, r], V [r, H]; F = H without lookback).

    weights: the top-r singular directions of W_res itself (best in Frobenius norm, whatever inputs it sees).
    inputs: reduced-rank ridge: the top-r right singular vectors V of (Pxx + λI)^½ W_res, and U = W_res Vᵀ, the
      rank-r map that loses the least of the fitted predictions on the calibration inputs (the rows the layer
      sees) under the same ridge penalty; directions the inputs rarely use get no rank. q, e_reg: Pxx = Q diag(e) Qᵀ
      and e + λ."""
    if basis == "weights":
        u, s, vh = torch.linalg.svd(w_res, full_matrices=False)
        return u[:, :rank] * s[:rank], vh[:rank]
    if basis != "inputs":
        raise ValueError(f"rank basis {basis!r} not in {RANK_BASES}")
    root = (q * e_reg.sqrt()) @ q.T  # (Pxx + λI)^½  [F, F]
    v = torch.linalg.svd(root @ w_res, full_matrices=False)[2][:rank]  # [r, H]
    return w_res @ v.T, v
