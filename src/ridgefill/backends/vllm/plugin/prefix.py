"""Prefix caching with RidgeFill (imported only inside vLLM; the hooks act in the engine core, where the scheduler
and its KV cache manager run).

A cached block of a filled request holds filled K/V in the late layers for its filled rows. Two rules keep every
cache hit correct:

1. **Namespaces.** A request that fills gets a cache salt derived from the fill (the maps' sha256, the split, its
   keep-first and the outlier factor: `fill_salt`), joined to any salt the client gave; a request that runs exact
   (its tail covers its prompt, or it asks for prompt log-probs) gets none. vLLM hashes the salt into its first
   block, so every block hash after it differs: exact requests never read filled blocks, and filled requests read
   only blocks filled with the same maps and settings. (The tail is not in the salt: rule 2 covers it.)
2. **A filled request computes its own tail.** Its cache hit is cut to the blocks that end at or before its first
   tail row (P - T, rounded down to the block size), so every row it must run in full it computes itself, never
   reading another request's filled K/V for it.

What a hit means for a filled request: rows served from the cache keep the state they were computed with, rows it
computes follow the fill rule. A row served from the cache was filled there only if the request that computed it
filled it (its own rule: row < its P - T and past its keep-first, not an outlier of its step); a row another request
ran in full (its tail, a generated token of an earlier turn) comes back exact where this request would have filled
it. So a second chat turn that extends the first reads the first turn's filled rows as filled, and the first turn's
tail and generated tokens as exact. Outlier decisions and (with lookback maps) the rows without a window are those
of the step that computed the block.
"""

from __future__ import annotations

import hashlib

from ridgefill.method.fill import FillSettings
from ridgefill.backends.vllm.plugin.private import (block_lists, cache_blocks, cache_salt, prompt_length, prompt_tokens,
                                          sampling_params, set_cache_salt)
from ridgefill.backends.vllm.requests import request_rule


def fill_salt(fill: FillSettings, keep_first: int) -> str:
    """The cache namespace of requests filled with `fill` and `keep_first` leading rows in full."""
    key = f"{fill.maps_sha256 or fill.maps}|{fill.split}|{keep_first}|{float(fill.outlier_factor)!r}"
    return "ridgefill:" + hashlib.sha256(key.encode()).hexdigest()[:24]


def request_fill(request, fill: FillSettings) -> tuple[int, int] | None:
    """(tail, keep_first) of a request that fills, None for one that runs exact."""
    prompt = prompt_length(request)
    tail, keep = request_rule(sampling_params(request), prompt, fill.tail, fill.keep_first)
    return None if tail + keep >= prompt else (tail, keep)


def salted(salt: str | None, ours: str) -> str:
    return ours if not salt else f"{salt}|{ours}"


def salted_request(stock, cls, request, block_hasher, fill: FillSettings):
    """Request.from_engine_core_request (vLLM's `stock`) with a filled request's cache salt joined to its own."""
    rule = None if sampling_params(request) is None else request_fill(request, fill)
    if rule is not None:
        set_cache_salt(request, salted(cache_salt(request), fill_salt(fill, rule[1])))
    return stock(cls, request, block_hasher)


def cut_cache_hit(stock, manager, request, fill: FillSettings):
    """KVCacheManager.get_computed_blocks (vLLM's `stock`) with a filled request's hit cut to the blocks that end
    before its tail."""
    blocks, hit, boundary = stock(manager, request)
    if hit == 0 or sampling_params(request) is None:
        return blocks, hit, boundary
    rule = request_fill(request, fill)
    if rule is None:
        return blocks, hit, boundary
    groups = block_lists(blocks)
    size = hit // max(1, len(groups[0]))  # tokens per block (one KV cache group: dense models)
    keep = max(0, (prompt_tokens(request) - rule[0]) // size)  # blocks that end before the tail
    if keep * size >= hit:
        return blocks, hit, boundary
    return cache_blocks(tuple(group[:keep] for group in groups)), keep * size, 0
