"""One streaming pass over calibration text: float64 sufficient statistics of the split state X and every
late layer's input Y_l, for one or several splits at once.

For split S and each late layer l = S+1..L-1 it accumulates XᵀX, XᵀY_l, ΣX, ΣY_l, Σ‖Y_l‖² and the row
count (layer S needs no map: its input is X itself). With `normalized`, also the same sums of the per-row
normalised targets Y_l / rms(Y_l) (every row rescaled to rms 1: the late layer normalises its input, so only
the direction of a prediction matters); `fit --targets normalized` fits to them. Memory does not grow with the
token count: beside the sums it holds one chunk's inputs of the late layers (see below). Held-out
sequences accumulate the same statistics separately, in two parts: `val` (fit chooses λ on it) and `test`
(fit reports its error on it). The statistics live on the model's device; they go to the CPU only to be saved.

With `lookback` K the map's input is not x_t alone but x_t and the split states of the K rows before it
(torchfill/lookback.py): X is then [x_t, x_{t-1}, .., x_{t-K}] ((K+1)·H wide) in XᵀX, XᵀY_l and ΣX (Σ‖x‖² stays
that of x_t: identity fill's error needs it), and a row whose window holds a row kept out is kept out too.

Rows kept out of the regression (and counted): the first `skip_first` rows of each sequence (attention
sinks; with lookback K, the K rows after them too), rows with a NaN or an infinity in the split state x or in
any late layer's input y_l (fp16 overflow; with lookback K, also the K rows after each such row), and rows whose
split-state norm exceeds `outlier_factor` times the SEQUENCE's median norm of the finite rows (with lookback K,
also the K rows after each such row). When the runner runs a sequence in several chunks, that median is only known
after the last chunk, so `accumulate` then runs the sequence twice: a first pass that records only the split
states' norms, and the accumulating pass (about twice the time; a sequence that fits one chunk, or
`outlier_factor` 0, runs once). Whether a row's late inputs are finite is only known once the chunk's last layer
has run, so the rows kept at the split are added then, with each late layer's inputs, which wait in the model's
dtype (one copy of the chunk's rows per late layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ridgefill.torchfill import Runner
from ridgefill.torchfill.lookback import lookback_windows, window_states
from ridgefill.errors import RidgefillError

PARTS = ("train", "val", "test")
OUTLIER_FACTOR = 20.0  # default: a row whose split-state norm exceeds this x the median is an outlier
HELD_OUT = ("val", "test")  # held-out sequences alternate between them: val chooses λ, test reports
SUMS = ("xtx", "xsum", "xty", "ysum", "yy", "xx")  # the float64 tensors of a SplitStats
NORMALIZED_SUMS = ("xtyn", "ysumn", "yyn")  # the same sums of the normalised targets (optional)
COUNTS = ("count", "skipped_first", "skipped_outliers", "skipped_nonfinite")  # older files: the first 3


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first of `tensors` holding a NaN or an infinity (None: all finite)."""
    return next((name for name, t in tensors.items() if not bool(torch.isfinite(t).all())), None)


def sum_of_squares(rows: torch.Tensor) -> torch.Tensor:
    """Σ‖row‖² of rows [n, W] in an order that does not depend on torch's thread count: each row's sum, then a
    running sum over the rows (torch splits a whole-tensor sum over its threads, and 1 and 2 threads rounded the
    last digit of SmolLM2's Σ‖y‖² differently)."""
    if rows.shape[0] == 0:
        return rows.new_zeros(())
    return (rows * rows).sum(-1).cumsum(0)[-1]


def check_fittable(splits: list[int], n_layers: int) -> None:
    """Refuse split L-1: its only late layer is L-1 itself, whose input is x, so no map is left to fit."""
    last = [s for s in splits if s >= n_layers - 1]
    if last:
        raise RidgefillError(f"split {last[0]} leaves nothing to fit on this {n_layers}-layer model: layer {last[0]} "
                             f"is the last and its input is x itself; use a split in 1..{n_layers - 2}")


@dataclass
class SplitStats:
    """Sufficient statistics for one split and one part. Shapes: H hidden, M = L-S-1 maps, F = (K+1)·H the maps'
    input width (F = H without lookback)."""

    split: int
    xtx: torch.Tensor  # [F, F]
    xsum: torch.Tensor  # [F]
    xty: torch.Tensor  # [M, F, H]
    ysum: torch.Tensor  # [M, H]
    yy: torch.Tensor  # [M]  Σ‖y‖²
    xx: torch.Tensor  # []   Σ‖x_t‖²  (for the identity baseline's error)
    count: int = 0
    skipped_first: int = 0
    skipped_outliers: int = 0
    skipped_nonfinite: int = 0  # rows with a NaN or Inf in x or in a late layer's input (and, with lookback, after)
    xtyn: torch.Tensor | None = None  # [M, F, H]  Xᵀ(Y / rms(Y)), rms per row; None: not collected
    ysumn: torch.Tensor | None = None  # [M, H]
    yyn: torch.Tensor | None = None  # [M]  Σ‖y / rms(y)‖² (= H per row)

    @classmethod
    def empty(cls, split: int, n_layers: int, hidden: int, device: str | torch.device = "cpu",
              normalized: bool = False, lookback: int = 0) -> "SplitStats":
        m, f = n_layers - split - 1, hidden * (lookback + 1)
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        extra = (z(m, f, hidden), z(m, hidden), z(m)) if normalized else (None, None, None)
        return cls(split, z(f, f), z(f), z(m, f, hidden), z(m, hidden), z(m), z(()),
                   **dict(zip(NORMALIZED_SUMS, extra)))

    @property
    def has_normalized(self) -> bool:
        return self.xtyn is not None

    @property
    def lookback(self) -> int:
        """K: the rows before each row whose split states are among the maps' inputs."""
        return self.xsum.shape[0] // self.ysum.shape[-1] - 1

    def add_x(self, x: torch.Tensor) -> None:
        """x [n, F] float64 map inputs of the kept rows (their split states first)."""
        own = x[:, : self.ysum.shape[-1]]
        self.xtx += x.T @ x
        self.xsum += x.sum(0)
        self.xx += sum_of_squares(own)
        self.count += x.shape[0]

    def add_y(self, index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Map `index` (layer S+1+index): x [n, F], y [n, H] float64 for the same kept rows."""
        self.xty[index] += x.T @ y
        self.ysum[index] += y.sum(0)
        self.yy[index] += sum_of_squares(y)
        if self.xtyn is not None:
            rms = (y * y).mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(y.dtype).tiny)  # [n, 1]
            yn = y / rms
            self.xtyn[index] += x.T @ yn
            self.ysumn[index] += yn.sum(0)
            self.yyn[index] += sum_of_squares(yn)

    def _names(self) -> tuple[str, ...]:
        return SUMS + (NORMALIZED_SUMS if self.has_normalized else ())

    def sums(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._names()]

    def nonfinite(self) -> str | None:
        """The name of the first sum holding a NaN or an infinity (None: every sum is finite)."""
        return first_nonfinite(dict(zip(self._names(), self.sums())))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.{n}": getattr(self, n) for n in self._names()}
        out[f"{prefix}.counts"] = torch.tensor([getattr(self, n) for n in COUNTS])  # [len(COUNTS)] int64
        return out

    @classmethod
    def from_tensors(cls, split: int, prefix: str, t: dict[str, torch.Tensor],
                     device: str | torch.device = "cpu") -> "SplitStats":
        counts = [int(v) for v in t[f"{prefix}.counts"]]  # a file from before skipped_nonfinite holds 3
        counts += [0] * (len(COUNTS) - len(counts))
        sums = [t[f"{prefix}.{n}"].to(device) for n in SUMS]
        extra = {n: t[f"{prefix}.{n}"].to(device) for n in NORMALIZED_SUMS if f"{prefix}.{n}" in t}
        return cls(split, *sums, **dict(zip(COUNTS, counts)), **extra)

    def normalized_targets(self, scale: torch.Tensor) -> "SplitStats":
        """These statistics with the normalised targets as Y, each map's rescaled by `scale` [M] (so a row's
        target is y · scale / rms(y): every row the same norm, the one given)."""
        if not self.has_normalized:
            raise ValueError("no normalised-target statistics")
        return SplitStats(self.split, self.xtx, self.xsum, self.xtyn * scale[:, None, None],
                          self.ysumn * scale[:, None], self.yyn * scale.square(), self.xx,
                          **{n: getattr(self, n) for n in COUNTS})


@dataclass
class Calibration:
    """Statistics for every split and part, plus how many sequences and tokens were consumed."""

    splits: list[int]
    stats: dict[tuple[int, str], SplitStats]
    sequences_done: int = 0
    tokens_done: int = 0
    meta: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, splits: list[int], n_layers: int, hidden: int, device: str | torch.device = "cpu",
              normalized: bool = False, lookback: int = 0) -> "Calibration":
        stats = {(s, p): SplitStats.empty(s, n_layers, hidden, device, normalized, lookback) for s in splits
                 for p in PARTS}
        return cls(sorted(splits), stats)

    @property
    def lookback(self) -> int:
        return next(iter(self.stats.values())).lookback if self.stats else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every statistic by name ("s{split}.{part}.{name}"), on the device they live on."""
        out = {}
        for (s, p), st in self.stats.items():
            out.update(st.tensors(f"s{s}.{p}"))
        return out

    @classmethod
    def from_tensors(cls, splits: list[int], tensors: dict, meta: dict,
                     device: str | torch.device = "cpu") -> "Calibration":
        """The statistics of `splits` in `tensors`, moved to `device`. A part missing from the file (the test
        part of a file written before held-out rows were split into val and test) is left out of `stats`."""
        stats = {(s, p): SplitStats.from_tensors(s, f"s{s}.{p}", tensors, device) for s in splits for p in PARTS
                 if f"s{s}.{p}.counts" in tensors}
        return cls(sorted(splits), stats, meta.get("sequences_done", 0), meta.get("tokens_done", 0), meta)

    def reduce(self, reduce_sum: Callable[[torch.Tensor], None], root: bool) -> None:
        """Sum every process's statistics into the root's, in place: `reduce_sum(t)` adds every process's `t`
        into the root's `t` (torch.distributed.reduce). The other processes then start again from zero, so each
        row is counted once and no second copy of the statistics is held. `sequences_done` is the caller's."""
        device = self.stats[next(iter(self.stats))].xsum.device
        keys = list(self.stats)
        counts = torch.tensor([getattr(self.stats[k], n) for k in keys for n in COUNTS] + [self.tokens_done],
                              device=device)  # [len(COUNTS) * parts + 1] int64
        for st in self.stats.values():
            for t in st.sums():
                reduce_sum(t)
        reduce_sum(counts)
        values = counts.tolist() if root else [0] * len(counts)
        for i, k in enumerate(keys):
            for j, n in enumerate(COUNTS):
                setattr(self.stats[k], n, values[len(COUNTS) * i + j])
            if not root:
                for t in self.stats[k].sums():
                    t.zero_()
        self.tokens_done = values[-1]


def _split_rows(h: torch.Tensor, positions: torch.Tensor, skip_first: int):
    """The split state's rows as float64 [B*n, H], which of them are past the sinks [B*n] bool, and their
    norms [B*n] (all on h's device). A row holding a NaN or an infinity has a non-finite norm (a finite row's
    cannot overflow in float64)."""
    rows = h.reshape(-1, h.shape[-1]).to(torch.float64)
    keep = positions.to(h.device).repeat(h.shape[0]) >= skip_first
    return rows, keep, rows.norm(dim=-1)


class _SplitNorms:
    """An observer (of Runner.prefill) of a first pass: the norms of each split state's finite rows past the sinks,
    chunk by chunk."""

    def __init__(self, splits: list[int], skip_first: int):
        self.skip_first = skip_first
        self.norms: dict[int, list[torch.Tensor]] = {s: [] for s in splits}

    def __call__(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> None:
        if layer in self.norms:
            _, keep, norms = _split_rows(h, positions, self.skip_first)
            self.norms[layer].append(norms[keep & norms.isfinite()])

    def medians(self) -> dict[int, torch.Tensor | None]:
        """Per split: the median norm over the whole sequence (None: no finite row past the sinks)."""
        whole = {s: torch.cat(parts) for s, parts in self.norms.items()}
        return {s: (n.median() if n.numel() else None) for s, n in whole.items()}


@dataclass
class _Kept:
    """A chunk's rows kept at a split, waiting for the late layers' inputs: keep [B*n] bool, which rows; x [k, F]
    float64, their map inputs. With lookback K: index [n, K], the windows of the chunk's rows as indices into the
    rows carried from the sequence's previous chunk (the first `carried`) followed by the chunk's own."""

    keep: torch.Tensor
    x: torch.Tensor
    index: torch.Tensor | None = None
    carried: int = 0


class _Collector:
    """An observer (of Runner.prefill): keeps each split's rows at the split layer and a copy of every later layer's
    input; when the chunk's last layer has run, adds the kept rows whose late inputs are all finite (module docstring).
    medians: the per-sequence median split-state norm of each split, when a first pass found it; without it the
    median is taken over the rows seen at once (the whole sequence, when it runs in one chunk)."""

    def __init__(self, calibration: Calibration, part: str, skip_first: int, outlier_factor: float,
                 medians: dict[int, torch.Tensor | None] | None = None):
        self.cal, self.part = calibration, part
        self.skip_first, self.outlier_factor, self.medians = skip_first, outlier_factor, medians
        self.kept: dict[int, _Kept] = {}  # split -> the chunk's rows kept at it
        self.late: dict[int, torch.Tensor] = {}  # layer -> the chunk's inputs of that layer [B*n, H], model dtype
        self.lookback = calibration.lookback
        any_stats = next(iter(calibration.stats.values()))
        self.n_layers = any_stats.split + 1 + any_stats.xty.shape[0]
        # split -> the sequence's last K rows seen: (split states [B, K', H], positions [K'], kept out [B, K'],
        # non-finite [B, K'])
        self.carry: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> None:
        if layer == self.n_layers:  # the final residual stream: every late input of the chunk has been seen
            self._add_chunk()
            return
        if layer in self.cal.splits:
            self.kept[layer] = self._keep(layer, h, positions)
        if layer > min(self.cal.splits):
            self.late[layer] = h.reshape(-1, h.shape[-1]).clone()  # [B*n, H]

    def _keep(self, split: int, h: torch.Tensor, positions: torch.Tensor) -> _Kept:
        """The chunk's rows kept at `split` (past the sinks, finite, not outliers and, with lookback, with a window
        clear of rows kept out); the others are counted."""
        rows, keep, norms = _split_rows(h, positions, self.skip_first)
        st = self.cal.stats[(split, self.part)]
        st.skipped_first += int((~keep).sum())
        nonfinite = keep & ~norms.isfinite()  # [B*n]
        st.skipped_nonfinite += int(nonfinite.sum())
        keep &= ~nonfinite
        median = self._median(split, keep, norms)
        if median is not None:
            outlier = keep & (norms > self.outlier_factor * median)
            st.skipped_outliers += int(outlier.sum())
            keep &= ~outlier
        if self.lookback:
            return self._with_windows(split, rows.view(h.shape), positions, keep, nonfinite, st)
        return _Kept(keep, rows[keep])

    def _with_windows(self, split: int, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                      nonfinite: torch.Tensor, st: SplitStats) -> _Kept:
        """x [B, n, H] float64 split states of a chunk's rows -> the rows kept with their maps' inputs [k, F] (x_t
        and its lookback window, torchfill/lookback.py). Clears `keep` [B·n] (in place) for rows whose window is not
        whole: it reaches a sink row (counted as skipped_first), a non-finite row (`nonfinite` [B·n], counted as
        skipped_nonfinite) or an outlier (counted as skipped_outliers). The window may reach into the sequence's
        previous chunk."""
        b, n, h = x.shape
        positions = positions.to(x.device)
        out = ~keep.view(b, n)  # [B, n] rows kept out: no window may hold them
        bad = nonfinite.view(b, n)  # [B, n] those of them with a non-finite split state
        carried = 0
        if split in self.carry:
            before, before_pos, before_out, before_bad = self.carry[split]
            carried = before_pos.shape[0]
            x, positions = torch.cat([before, x], 1), torch.cat([before_pos, positions])
            out, bad = torch.cat([before_out, out], 1), torch.cat([before_bad, bad], 1)
        k = self.lookback
        self.carry[split] = (x[:, -k:], positions[-k:], out[:, -k:], bad[:, -k:])
        none = torch.zeros_like(positions, dtype=torch.bool)  # the rows kept out are handled below, by kind
        index, whole = lookback_windows(positions, torch.zeros_like(positions), none, k, self.skip_first)
        index, whole = index[-n:], whole[-n:]  # the chunk's own rows
        reaches_out, reaches_bad = out[:, index].any(-1), bad[:, index].any(-1)  # [B, n]
        kept = keep.view(b, n)
        lost = {"skipped_first": kept & ~whole, "skipped_nonfinite": kept & whole & reaches_bad,
                "skipped_outliers": kept & whole & reaches_out & ~reaches_bad}
        for name, rows in lost.items():
            setattr(st, name, getattr(st, name) + int(rows.sum()))
        keep &= (whole & ~reaches_out).reshape(-1)
        inputs = torch.cat([x[:, -n:], window_states(x, index)], -1).reshape(b * n, -1)  # [B·n, F]
        return _Kept(keep, inputs[keep], index, carried)

    def _median(self, layer: int, keep: torch.Tensor, norms: torch.Tensor) -> torch.Tensor | None:
        """The median the outlier rule compares with (None: the rule is off, or no row to take it over)."""
        if self.outlier_factor <= 0:
            return None
        if self.medians is not None:
            return self.medians[layer]
        return norms[keep].median() if keep.any() else None

    def _add_chunk(self) -> None:
        """Add each split's kept rows with every late layer's inputs for them, but for the rows with a NaN or an
        infinity in a late input and, with lookback, the rows whose window holds one (counted as skipped_nonfinite)."""
        for split, kept in self.kept.items():
            st = self.cal.stats[(split, self.part)]
            late = [self.late[layer] for layer in range(split + 1, self.n_layers)]  # [B*n, H] each
            bad = torch.zeros_like(kept.keep)  # [B*n]
            for y in late:
                bad |= ~y.isfinite().all(-1)
            bad &= kept.keep
            if self.lookback:
                bad |= self._windows_holding(split, kept, bad)
            st.skipped_nonfinite += int(bad.sum())
            keep, x = kept.keep & ~bad, kept.x[~bad[kept.keep]]
            st.add_x(x)
            for index, y in enumerate(late):
                st.add_y(index, x, y[keep].to(torch.float64))
        self.kept.clear()
        self.late.clear()

    def _windows_holding(self, split: int, kept: _Kept, bad: torch.Tensor) -> torch.Tensor:
        """The kept rows [B*n] whose lookback window holds one of the rows `bad` [B*n] (a non-finite late input).
        Those rows are marked kept out and non-finite in the carry too, so the next chunk's windows avoid them."""
        n = kept.index.shape[0]
        b = bad.numel() // n
        rows = torch.cat([bad.new_zeros(b, kept.carried), bad.view(b, n)], 1)  # [B, carried + n]
        x, positions, out, nonfinite = self.carry[split]
        k = out.shape[1]  # the carry holds the last k of those rows
        self.carry[split] = (x, positions, out | rows[:, -k:], nonfinite | rows[:, -k:])
        return kept.keep & rows[:, kept.index].any(-1).reshape(-1)


def accumulate(runner: Runner, calibration: Calibration, ids: torch.Tensor, part: str,
               skip_first: int = 1, outlier_factor: float = OUTLIER_FACTOR, chunk: int | None = None,
               window=None) -> None:
    """Run one exact prefill of `ids` [B, T] in chunks of `chunk` rows (default: the runner's) and add its rows
    to `calibration` (part 'train', 'val' or 'test'). When that takes several chunks and the outlier rule is on,
    a first pass finds each split state's median norm over the whole sequence (see the module docstring).
    window (torchfill.FilledWindow): the rows past its sinks attend locally in its layers, as filled rows will."""
    chunk = chunk or runner.chunk
    medians = None
    if outlier_factor > 0 and chunk < ids.shape[1]:
        norms = _SplitNorms(calibration.splits, skip_first)
        runner.prefill(ids, observe=norms, logits_at=[], chunk=chunk, window=window)
        medians = norms.medians()
    collector = _Collector(calibration, part, skip_first, outlier_factor, medians)
    runner.prefill(ids, observe=collector, logits_at=[], chunk=chunk, window=window)
    calibration.tokens_done += ids.numel()
    calibration.sequences_done += ids.shape[0]
