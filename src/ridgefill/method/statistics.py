"""One streaming pass over calibration text: float64 sufficient statistics of the split state X and every
late layer's input Y_l, for one or several splits at once.

For split S and each late layer l = S+1..L-1 it accumulates XᵀX, XᵀY_l, ΣX, ΣY_l, Σ‖Y_l‖² and the row
count (layer S needs no map: its input is X itself). Memory does not grow with the token count. A held-out
share of sequences accumulates the same statistics separately, for validation.

Rows kept out of the regression (and counted): the first `skip_first` rows of each sequence (attention
sinks) and rows whose split-state norm exceeds `outlier_factor` times the sequence's median norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ridgefill.engine import Engine

PARTS = ("train", "val")


@dataclass
class SplitStats:
    """Sufficient statistics for one split and one part (train or val). Shapes: H hidden, M = L-S-1 maps."""

    split: int
    xtx: torch.Tensor  # [H, H]
    xsum: torch.Tensor  # [H]
    xty: torch.Tensor  # [M, H, H]
    ysum: torch.Tensor  # [M, H]
    yy: torch.Tensor  # [M]  Σ‖y‖²
    xx: torch.Tensor  # []   Σ‖x‖²  (for the identity baseline's error)
    count: int = 0
    skipped_first: int = 0
    skipped_outliers: int = 0

    @classmethod
    def empty(cls, split: int, n_layers: int, hidden: int) -> "SplitStats":
        m = n_layers - split - 1
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        return cls(split, z(hidden, hidden), z(hidden), z(m, hidden, hidden), z(m, hidden), z(m), z(()))

    def add_x(self, x: torch.Tensor) -> None:
        """x [n, H] float64 split states of the kept rows."""
        self.xtx += x.T @ x
        self.xsum += x.sum(0)
        self.xx += (x * x).sum()
        self.count += x.shape[0]

    def add_y(self, index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Map `index` (layer S+1+index): x, y [n, H] float64 for the same kept rows."""
        self.xty[index] += x.T @ y
        self.ysum[index] += y.sum(0)
        self.yy[index] += (y * y).sum()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        names = ("xtx", "xsum", "xty", "ysum", "yy", "xx")
        out = {f"{prefix}.{n}": getattr(self, n) for n in names}
        out[f"{prefix}.counts"] = torch.tensor([self.count, self.skipped_first, self.skipped_outliers])
        return out

    @classmethod
    def from_tensors(cls, split: int, prefix: str, t: dict[str, torch.Tensor]) -> "SplitStats":
        count, first, outliers = (int(v) for v in t[f"{prefix}.counts"])
        return cls(split, t[f"{prefix}.xtx"], t[f"{prefix}.xsum"], t[f"{prefix}.xty"], t[f"{prefix}.ysum"],
                   t[f"{prefix}.yy"], t[f"{prefix}.xx"], count, first, outliers)


@dataclass
class Calibration:
    """Statistics for every split, train and val, plus how many sequences were consumed."""

    splits: list[int]
    stats: dict[tuple[int, str], SplitStats]
    sequences_done: int = 0
    tokens_done: int = 0
    meta: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, splits: list[int], n_layers: int, hidden: int) -> "Calibration":
        stats = {(s, p): SplitStats.empty(s, n_layers, hidden) for s in splits for p in PARTS}
        return cls(sorted(splits), stats)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for (s, p), st in self.stats.items():
            out.update(st.tensors(f"s{s}.{p}"))
        return out

    @classmethod
    def from_tensors(cls, splits: list[int], tensors: dict, meta: dict) -> "Calibration":
        stats = {(s, p): SplitStats.from_tensors(s, f"s{s}.{p}", tensors) for s in splits for p in PARTS}
        return cls(sorted(splits), stats, meta.get("sequences_done", 0), meta.get("tokens_done", 0), meta)


class _Collector:
    """Engine observer: buffers each split's kept rows and adds every later layer's inputs for them."""

    def __init__(self, calibration: Calibration, part: str, skip_first: int, outlier_factor: float):
        self.cal, self.part = calibration, part
        self.skip_first, self.outlier_factor = skip_first, outlier_factor
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # split -> (row mask [n], x [k, H])

    def __call__(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> None:
        rows = h.reshape(-1, h.shape[-1]).to(torch.float64)  # [B*n, H]
        positions = positions.repeat(h.shape[0]).cpu()
        if layer in self.cal.splits:
            st = self.cal.stats[(layer, self.part)]
            keep = positions >= self.skip_first
            st.skipped_first += int((~keep).sum())
            norms = rows.norm(dim=-1).cpu()
            if keep.any() and self.outlier_factor > 0:
                outlier = keep & (norms > self.outlier_factor * norms[keep].median())
                st.skipped_outliers += int(outlier.sum())
                keep &= ~outlier
            x = rows[keep.to(rows.device)]
            st.add_x(x)
            self.kept[layer] = (keep, x)
        for split, (keep, x) in self.kept.items():
            index = layer - split - 1
            if 0 <= index < self.cal.stats[(split, self.part)].xty.shape[0]:
                self.cal.stats[(split, self.part)].add_y(index, x, rows[keep.to(rows.device)])


def accumulate(engine: Engine, calibration: Calibration, ids: torch.Tensor, part: str,
               skip_first: int = 1, outlier_factor: float = 20.0, chunk: int | None = None) -> None:
    """Run one exact prefill of `ids` [B, T] and add its rows to `calibration` (part 'train' or 'val')."""
    collector = _Collector(calibration, part, skip_first, outlier_factor)
    engine.prefill(ids, observe=collector, logits_at=[], chunk=chunk or ids.shape[1])
    calibration.tokens_done += ids.numel()
    calibration.sequences_done += ids.shape[0]
