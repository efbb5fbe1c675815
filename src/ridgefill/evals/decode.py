"""Greedy generation that continues from a cache built elsewhere (e.g. a spliced prefix cache)."""

from __future__ import annotations

from typing import Sequence

import torch

from ridgefill.torchfill import Cache, Runner


@torch.inference_mode()
def greedy_after_cache(runner: Runner, cache: Cache, ids: torch.Tensor, max_new_tokens: int,
                       eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """Run the prompt rows `ids` [1, n] in full after `cache` (which they extend), then decode greedily.
    Returns up to `max_new_tokens` token ids, ending at the first end-of-sequence token if one comes."""
    capacity = cache.length + ids.shape[1] + max_new_tokens
    logits = runner.prefill(ids, cache=cache, capacity=capacity).logits  # [1, 1, V] at the last row
    return runner.decode_greedy(cache, logits[:, -1].argmax(-1), max_new_tokens, eos_token_id)[0]
