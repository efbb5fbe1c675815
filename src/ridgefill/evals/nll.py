"""Teacher-forced negative log-likelihood on the rows that run the full model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridgefill.engine import Engine, FillPlan


def tail_nll(engine: Engine, ids: torch.Tensor, tail: int, fill: FillPlan | None = None) -> torch.Tensor:
    """Per-token NLL [B, tail-1] of tokens N-tail+1..N-1, each predicted from the row before it.
    The filled rows are never scored: every variant scores the same tail tokens."""
    n = ids.shape[1]
    rows = list(range(n - tail, n - 1))
    logits = engine.prefill(ids, fill=fill, logits_at=rows).logits  # [B, tail-1, V]
    targets = ids[:, n - tail + 1 :].to(logits.device)
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
