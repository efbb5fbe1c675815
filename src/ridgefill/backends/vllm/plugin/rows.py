"""Which rows of a vLLM batch are filled, and how the full rows are grouped for attention (no vLLM import).

A vLLM step packs the scheduled tokens of several requests into one flat batch: request r owns tokens
query_start[r]..query_start[r+1]-1, at absolute positions given per token. RidgeFill's rule per request
(prompt length P, tail T, keep_first K): a prompt token at position p is filled iff K <= p < P - T; every
other token (the tail, the first K, generated tokens being decoded or recomputed after preemption) is full.
The rule depends only on (p, P, T, K), so a prompt split over several steps (chunked prefill) or recomputed
after preemption fills exactly the same rows as one unchunked prefill.

In layers S..L-1 only full tokens run attention. They are packed into one smaller batch of *segments*: each
maximal run of consecutive full tokens of one request is a segment whose queries end at position e and
attend to keys 0..e (seq_len e+1): the bottom-right-aligned causal layout every vLLM attention backend uses.
Splitting at filled rows keeps a leading kept row (position 0) from seeing keys after it.

vLLM's CUDA attention backends size some per-request metadata buffers by `max_num_seqs` (and, with CUDA graphs,
by the largest capture size), so a step may describe at most that many segments (`bound_runs`): beyond the bound,
the shortest stretches of filled rows between two runs of one request run in full (exact), closing those gaps,
until the runs fit. A step never holds more requests than max_num_seqs, so one run per request always fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridgefill.torchfill.rows import full_positions, outliers


def token_requests(query_start: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """query_start [R+1] (cumulative scheduled tokens) -> [n_tokens] the request index of each token;
    tokens past query_start[-1] (padding) get -1."""
    counts = (query_start[1:] - query_start[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = torch.full((n_tokens,), -1, dtype=torch.long)
    out[: owner.numel()] = owner
    return out


def full_tokens(positions: torch.Tensor, request: torch.Tensor, prompt_len: torch.Tensor, tail: torch.Tensor,
                keep_first: torch.Tensor) -> torch.Tensor:
    """[N] bool: True for tokens that run the full model.

    positions [N] absolute positions; request [N] request index (-1: padding, run as full so it stays out of
    the fill); prompt_len, tail, keep_first [R] per request."""
    r = request.clamp(min=0)
    return (request < 0) | full_positions(positions.long(), prompt_len[r], tail[r], keep_first[r])


def outlier_tokens(norms: torch.Tensor, request: torch.Tensor, full: torch.Tensor, factor: float) -> torch.Tensor:
    """[N] bool: filled tokens whose split-state norm exceeds `factor` x the median norm of their request's
    filled tokens in this step: the engine's one outlier rule (torchfill/rows.py outliers), each request a group.
    norms [N]; factor 0: none."""
    return outliers(norms, request, ~full, factor)


@dataclass(frozen=True)
class Segments:
    """The full tokens of a batch regrouped for attention: a batch of `n` pseudo-requests."""

    rows: torch.Tensor  # [F] indices into the batch of the full tokens, ascending
    request: torch.Tensor  # [n] the request each segment belongs to (its block-table row)
    query_start: torch.Tensor  # [n+1] int32 cumulative queries (over `rows`)
    seq_lens: torch.Tensor  # [n] int32: last position of the segment + 1

    @property
    def n(self) -> int:
        return self.request.numel()

    @property
    def max_query_len(self) -> int:
        return int((self.query_start[1:] - self.query_start[:-1]).max()) if self.n else 0


def bound_runs(full: torch.Tensor, request: torch.Tensor, limit: int) -> torch.Tensor:
    """full [N] bool with the fewest gaps closed so that its full tokens form at most `limit` segments: the gaps
    (filled rows between two runs of one request) close shortest first, the earlier of equal ones first. Runs of
    different requests never merge, so a step keeps one run per request with a full token whatever the limit."""
    rows = torch.nonzero(full & (request >= 0)).flatten()
    if rows.numel() <= limit:
        return full
    req = request[rows]
    start = torch.ones_like(rows, dtype=torch.bool)
    start[1:] = (rows[1:] != rows[:-1] + 1) | (req[1:] != req[:-1])
    first = torch.nonzero(start).flatten()  # [n] index into rows of each run's first token
    excess = first.numel() - limit
    if excess <= 0:
        return full
    ends, begins = rows[first[1:] - 1], rows[first[1:]]  # [n-1] each run's last row, the next run's first row
    same = req[first[1:]] == req[first[:-1]]  # gaps inside one request
    width = torch.where(same, begins - ends - 1, torch.full_like(ends, torch.iinfo(torch.long).max))
    chosen = torch.sort(width, stable=True).indices[:min(excess, int(same.sum()))]
    edges = torch.zeros(full.numel() + 1, dtype=torch.long)
    edges.index_add_(0, ends[chosen] + 1, torch.ones_like(chosen))
    edges.index_add_(0, begins[chosen], -torch.ones_like(chosen))
    return full | (edges.cumsum(0)[:-1] > 0)


def segments(full: torch.Tensor, request: torch.Tensor, positions: torch.Tensor) -> Segments:
    """Group the full tokens (full [N] bool, request [N], positions [N]) into segments (see the module doc).
    Padding tokens (request -1) are left out: they never attend."""
    rows = torch.nonzero(full & (request >= 0)).flatten()
    req = request[rows]
    if rows.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int32)
        return Segments(rows, req, torch.zeros(1, dtype=torch.int32), empty)
    start = torch.ones_like(rows, dtype=torch.bool)
    start[1:] = (rows[1:] != rows[:-1] + 1) | (req[1:] != req[:-1])
    first = torch.nonzero(start).flatten()  # [n] index (into rows) of each segment's first token
    last = torch.cat([first[1:] - 1, torch.tensor([rows.numel() - 1])])
    query_start = torch.cat([first, torch.tensor([rows.numel()])]).to(torch.int32)
    seq_lens = (positions[rows[last]].long() + 1).to(torch.int32)
    return Segments(rows, req[first], query_start, seq_lens)
