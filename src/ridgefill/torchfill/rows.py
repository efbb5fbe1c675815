"""Which prompt rows run the full model, and the one rule of each number that says so: the tail (tail_ok,
check_tail), the leading rows kept in full (keep_first_ok, check_keep_first) and the outlier factor
(check_outlier_factor), and the one outlier rule (outliers). Torchfill, the fill settings (method/fill_fields.py), RULER's placement and the vLLM
plugin's request options all check with these.
"""

from __future__ import annotations

import math

import torch

from ridgefill.errors import RidgefillError


def full_positions(positions: torch.Tensor, prompt_len, tail, keep_first) -> torch.Tensor:
    """The one rule of which prompt rows run the full model: True where a position is among the first `keep_first`
    or the last `tail` of a prompt of `prompt_len` rows (and past the prompt: generated tokens). Every other row is
    filled. positions [N]; prompt_len, tail, keep_first: numbers or tensors broadcast with positions (per token, as
    a vLLM step has them)."""
    return (positions < keep_first) | (positions >= prompt_len - tail)


MAX_ROWS = 2**31 - 1  # the most rows a prompt can have anywhere the fill runs (vLLM's positions are int32)


def tail_ok(tail, limit: int | None = None) -> bool:
    """The one tail rule: an integer of at least 1 (the last prompt row gives the first generated token and must run
    the full model), and at most `limit` when one is given."""
    return (not isinstance(tail, bool) and isinstance(tail, int) and tail >= 1
            and (limit is None or tail <= limit))


def check_tail(tail, name: str = "--tail") -> int:
    """The tail rule (tail_ok) as a one-line error naming `name`; returns tail."""
    if not tail_ok(tail):
        raise RidgefillError(f"{name} {tail} must be an integer of at least 1: the last prompt row gives the first "
                             "generated token and must run the full model")
    return tail


def check_outlier_factor(factor, name: str = "--outlier-factor") -> float:
    """The one outlier-factor rule: 0 (fill every row) or a finite positive number; returns factor."""
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if not number or not math.isfinite(factor) or factor < 0:
        shown = f"{factor:g}" if number else repr(factor)
        raise RidgefillError(f"{name} {shown} must be 0 (fill every row) or a finite positive number")
    return factor


def outliers(norms: torch.Tensor, groups: torch.Tensor, filled: torch.Tensor, factor: float) -> torch.Tensor:
    """The one outlier rule of torchfill and the vLLM plugin: [N] bool, True for filled rows whose
    split-state norm exceeds `factor` times the median norm (torch's lower median) of the filled rows of their
    group. norms [N]; groups [N] the group of each row (a prompt of the runner's batch, a request of a vLLM step);
    filled [N] bool, only those rows are judged or counted in a median; factor 0: no outliers."""
    out = torch.zeros_like(filled)
    if factor <= 0:
        return out
    for group in torch.unique(groups[filled]).tolist():
        rows = filled & (groups == group)
        out |= rows & (norms > factor * norms[rows].median())
    return out


def keep_first_ok(keep_first, limit: int | None = None) -> bool:
    """The one keep-first rule: an integer of at least 0 (leading rows that run in full), and at most `limit` when
    one is given."""
    return (not isinstance(keep_first, bool) and isinstance(keep_first, int) and keep_first >= 0
            and (limit is None or keep_first <= limit))


def check_keep_first(keep_first, limit: int = MAX_ROWS, name: str = "--keep-first", within: str = "") -> int:
    """The one keep-first rule of torchfill, `generate` and the vLLM plugin, checked before any work: a
    count of leading rows that run in full, an integer in 0..limit (`limit`: the most rows a prompt can have, e.g.
    the model's context, named by `within`); anything else is refused with one line (RidgefillError). A value
    inside the limit but past a prompt runs that whole prompt in full (exact), as a tail past the prompt does:
    `full_positions` clamps it, no row list is ever built from it. Returns keep_first."""
    if not keep_first_ok(keep_first):
        raise RidgefillError(f"{name} {keep_first} must be an integer of at least 0 (leading prompt rows that run in "
                             "full)")
    if keep_first > limit:
        raise RidgefillError(f"{name} {keep_first} is past the {limit} rows a prompt can have{within}: give at most "
                             f"{limit} (a keep-first at or past the prompt already runs all of it in full)")
    return keep_first
