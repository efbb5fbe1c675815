"""Greedy generation that continues from a cache built elsewhere (e.g. a spliced prefix cache)."""

from __future__ import annotations

from typing import Sequence

import torch

from ridgefill.engine import Cache, Engine


@torch.inference_mode()
def greedy_after_cache(engine: Engine, cache: Cache, ids: torch.Tensor, max_new_tokens: int,
                       eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """Run the prompt rows `ids` [1, n] in full after `cache` (which they extend), then decode greedily.
    Returns up to `max_new_tokens` token ids, ending at the first end-of-sequence token if one comes."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    capacity = cache.length + ids.shape[1] + max_new_tokens
    logits = engine.prefill(ids, cache=cache, capacity=capacity).logits  # [1, 1, V] at the last row
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos:
        logits = engine.decode_step(cache, torch.tensor([[out[-1]]]))  # [1, V]
        out.append(int(logits[0].argmax()))
    return out
