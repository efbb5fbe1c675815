"""Scoring what the full rows predict: teacher-forced negative log-likelihood of a tail or a continuation,
LongPPL's distant-context (key) tokens (those whose loss drops sharply when the model sees the full context
instead of a short window), and the log-likelihood of candidate continuations after one shared prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ridgefill.torchfill import Cache, Runner, FillPlan


def tail_nll(backend, variant: str, ids: torch.Tensor, tail: int) -> torch.Tensor:
    """Per-token NLL [B, tail-1] of tokens N-tail+1..N-1, each predicted from the row before it, by `variant` of
    `backend` (backends/base.Backend.nll). The filled rows are never scored: every variant scores the same tail
    tokens."""
    n = ids.shape[1]
    return backend.nll(variant, ids, list(range(n - tail, n - 1)), ids[:, n - tail + 1 :])


def continuation_nll(runner: Runner, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [B, n-1] of ids[:, 1:] when the rows `ids` [B, n] run the full model after `cache`
    (which they extend: pass a clone to keep it). With `cache` a prefix prefill of rows 0..N-n-1 this scores
    the same tokens as `tail_nll(runner, whole, n, ...)`."""
    n = ids.shape[1]
    logits = runner.prefill(ids, cache=cache, logits_at=range(n - 1)).logits  # [B, n-1, V]
    targets = ids[:, 1:].to(logits.device)
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def short_context_nll(backend, ids: torch.Tensor, tail: int, short: int, stride: int,
                      full_nll: torch.Tensor) -> torch.Tensor:
    """NLL [tail-1] of the tokens `tail_nll` scores (N-tail+1..N-1 of `ids` [1, N]) when the exact model (the
    backend's exact variant) sees only a short window of the tokens before each, as a fresh sequence starting at
    position 0.

    Targets are taken in blocks of `stride`; one window per block ends just before the block's last target and
    starts `short` tokens before its first, so the j-th target of a block sees short + j tokens (short..
    short+stride-1; stride 1: exactly `short`, one window per target). A target with at most `short` tokens
    before it sees all of them, so its short-context NLL is its full-context NLL `full_nll` [tail-1]."""
    n = ids.shape[1]
    first = n - tail + 1  # the first scored token
    out = full_nll.detach().float().cpu().clone()
    start = max(first, short + 1)  # earlier targets see their whole prefix: already in `out`
    stride = max(1, min(stride, n - start))  # a stride beyond the targets only widens the windows
    blocks = [(t0, min(t0 + stride, n)) for t0 in range(start, n, stride)]
    width = short + stride - 1  # window length; the last block's window is right-padded (causal: no effect)
    rows = list(range(short - 1, short - 1 + stride))  # window rows whose logits predict the block's targets
    per_batch = max(1, backend.chunk // width)
    seq = ids[0]
    for b0 in range(0, len(blocks), per_batch):
        batch = blocks[b0 : b0 + per_batch]
        windows = torch.stack([_padded(seq[t0 - short : t1 - 1], width) for t0, t1 in batch])  # [b, width]
        # a short block's targets past its end are padding (its window's own last token): scored, not kept
        targets = torch.stack([_padded(seq[t0:t1], stride) for t0, t1 in batch])  # [b, stride]
        nll = backend.nll("exact", windows, rows, targets).float().cpu()  # [b, stride]
        for (t0, t1), row_nll in zip(batch, nll):
            out[t0 - first : t1 - first] = row_nll[: t1 - t0]
    return out


def _padded(window: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a 1-D token window to `width` by repeating its last token."""
    if len(window) == width:
        return window
    return torch.cat([window, window[-1:].expand(width - len(window))])


def distant_tokens(full_nll: torch.Tensor, short_nll: torch.Tensor, alpha: float = 2.0,
                   beta: float = 2.0) -> torch.Tensor:
    """LongPPL's key tokens, bool like `full_nll`: the full context raises the token's log-prob by more than
    `alpha` over the short window, and its full-context log-prob is above -`beta`."""
    return (short_nll - full_nll > alpha) & (full_nll < beta)


def continuation_scores(runner: Runner, context: list[int], continuations: list[list[int]],
                        plan: FillPlan | None = None) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each continuation after one shared prefill of `context` (exact if `plan` is
    None). Continuation rows run the full model on a clone of the context's cache, so the context is prefilled
    once however many continuations there are; `greedy` says whether greedy decoding would produce it."""
    longest = max((len(c) for c in continuations), default=0)
    pre = runner.prefill(torch.tensor([context]), fill=plan, capacity=len(context) + longest)
    first = pre.logits[0, -1:].float().log_softmax(-1)  # [1, V]: predicts each continuation's first token
    scores = []
    for i, cont in enumerate(continuations):
        if not cont:
            scores.append((0.0, True))
            continue
        logprobs = first
        if len(cont) > 1:
            last_use = i == len(continuations) - 1
            cache = pre.cache if last_use else pre.cache.clone()
            rest = runner.prefill(torch.tensor([cont[:-1]]), cache=cache, logits_at="full").logits[0]  # [k-1, V]
            logprobs = torch.cat([first, rest.float().log_softmax(-1)])  # [k, V]
        target = torch.tensor(cont, device=logprobs.device)
        total = logprobs.gather(1, target.unsqueeze(1)).sum()
        scores.append((float(total), bool((logprobs.argmax(-1) == target).all())))
    return scores
