"""How to fill a prompt (FillPlan: the filler, tail, kept rows, outlier rule, window) and what its prefills did
(FillTally); the rules of which rows run in full are torchfill/rows.py's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from ridgefill.torchfill.fillers import Filler
from ridgefill.torchfill.rows import check_keep_first, check_outlier_factor, check_tail, full_positions, outliers
from ridgefill.torchfill.window import FilledWindow
from ridgefill.errors import RidgefillError


@dataclass
class FillTally:
    """What a fill did to prompt tokens, summed over every prompt: the one tally of every engine, in result documents
    (`to_dict`) and, by the same names, on a server's /metrics (ridgefill_<field>_total: backends/counters.py).
    A count an engine does not keep is None. Each prompt token is counted once, in filled, full or cached."""

    filled_tokens: int = 0  # prompt tokens filled: their late layers' K/V written from the maps
    outlier_tokens: int = 0  # tokens the rule fills that ran in full: their split state is an outlier
    lookback_full_tokens: int = 0  # ... ran in full: their maps' lookback window was not whole (torchfill/lookback.py)
    full_tokens: int | None = None  # prompt tokens run through every layer (the tail, keep-first, and the above)
    cached_prompt_tokens: int | None = None  # prompt tokens a server's prefix cache served (neither filled nor run)
    recomputed_prompt_tokens: int | None = None  # computed again after a server preempted their request
    run_bound_full_tokens: int | None = None  # ran in full: their step had more runs of full tokens than the
    # attention backend's metadata holds
    stock_steps: int | None = None  # a server's steps run stock (exact) because their fill could not be planned

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Promoted:
    """Rows of a chunk that would have been filled but ran in full, by cause."""

    outliers: int = 0  # their split state is an outlier (FillPlan.outlier_factor)
    unwindowed: int = 0  # their lookback window was not whole (and they are no outlier)

    def __add__(self, other: "Promoted") -> "Promoted":
        return Promoted(self.outliers + other.outliers, self.unwindowed + other.unwindowed)

    @property
    def total(self) -> int:
        return self.outliers + self.unwindowed


@dataclass
class FillPlan:
    """How to fill a prompt: which filler (and so which split), how many tail rows, which extra rows run in full.

    outlier_factor: a row that would be filled runs in full when its split-state norm exceeds this many times
    the median norm of its chunk's filled rows (calibration kept such rows, massive activations, out of the fit,
    so the map would be applied where it was never fitted); 0 fills them too. window: the filled rows' local
    attention below the split (torchfill/window.py; None: full attention). `tally` counts what happened."""

    filler: Filler
    tail: int
    keep_rows: Sequence[int] = ()
    outlier_factor: float = 0.0
    window: FilledWindow | None = None
    keep_first: int = 0  # the first keep_first rows run in full (check_keep_first: past a prompt, all of it)
    tally: FillTally = field(default_factory=FillTally, compare=False, repr=False)

    def __post_init__(self) -> None:
        bad = [r for r in self.keep_rows if not isinstance(r, int) or isinstance(r, bool) or r < 0]
        if bad:
            raise RidgefillError(f"keep row {bad[0]!r} is not a row index: keep rows are 0-based prompt positions")
        check_tail(self.tail, "tail")
        check_outlier_factor(self.outlier_factor, "outlier factor")
        check_keep_first(self.keep_first, name="keep-first")

    @property
    def split(self) -> int:
        return self.filler.split

    def full_rows(self, n: int) -> torch.Tensor:
        """[n] bool: True for rows that run the full model (before any outlier rows are added at the split)."""
        outside = [r for r in self.keep_rows if r >= n]
        if outside:
            raise RidgefillError(f"keep row {outside[0]} is outside the {n}-token prompt (rows 0..{n - 1}): keep "
                                 "rows inside the prompt")
        full = full_positions(torch.arange(n), n, self.tail, self.keep_first)
        if self.keep_rows:
            full[torch.tensor(list(self.keep_rows), dtype=torch.long)] = True
        return full

    def outlier_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, nF, H] split states of a chunk's filled rows -> [nF] bool: the rows to run in full instead."""
        if self.outlier_factor <= 0 or x.shape[1] == 0:
            return torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
        norms = torch.linalg.vector_norm(x.float(), dim=-1)  # [B, nF]: each prompt of the batch is one group
        groups = torch.arange(norms.shape[0], device=x.device).unsqueeze(1).expand_as(norms)
        filled = torch.ones(norms.shape, dtype=torch.bool, device=x.device)
        return outliers(norms.flatten(), groups.flatten(), filled.flatten(), self.outlier_factor).view(
            norms.shape).any(dim=0)
