"""RidgeFill inside vLLM on a hybrid model (Qwen3-Next: Gated DeltaNet layers between gated full-attention
layers, MoE MLPs), in bf16, the only dtype of vLLM's CPU Gated DeltaNet kernel. A tiny random-init checkpoint
(vllm_fixtures.vllm_hybrid) against stock vLLM and against ridgefill's own engine in bf16.

The tolerances are bf16's: on these prompts ridgefill's own engine in bf16 against itself in fp32 differs by up to
0.28 nats in the first token's top log-probs, and stock vLLM against the engine (both exact, bf16) by up to 0.29
(measured 2026-12-03); the bars below sit just above those, and each comparison of the fill is checked against the
same comparison of exact prefill, so a wrong fill (rows, states or K/V) shows as a gap the exact runs do not have.
"""

from __future__ import annotations

import pytest

from ridgefill.method.fill import FillSettings
from ridgefill.serve.vllm_engine import EngineSettings
from vllm_fixtures import prompts, reference, tally_delta, vocab_of

pytest.importorskip("vllm")

MAX_LEN = 2048
NEW = 160  # tokens generated per request in test 3 (long enough that running requests outgrow the KV budget)
HELD = 16  # test 3: the tokens of each batched request checked against the same request run alone
STEPPED_MAX_LEN = 1536  # test 3's engine: its longest request is 1,200 + 160 tokens
TAIL = 24
SHORT_TAIL = 4  # test 2: the last rows see the filled rows' K/V and states closely (with 24 the states forget them)
FILL_DOMINATED_TOL = 0.45  # nats, at tail 4 (measured 0.39 on one prompt, 0.05-0.17 on the others)
BF16_LOGPROB_TOL = 0.35  # nats, first token's top-5 (bf16: engine vs itself in fp32 0.28, vLLM vs engine 0.29)


def settings(folder, fill: FillSettings | None = None, plugin: bool = True, max_model_len: int = MAX_LEN,
             **engine_args) -> EngineSettings:
    """An engine as `ridgefill serve` runs a hybrid: bf16, prefix caching off (vllm_config.PREFIX_CACHING_HYBRID);
    eager (compiling costs minutes here)."""
    return EngineSettings(str(folder), fill, plugin=plugin, dtype="bfloat16", max_model_len=max_model_len,
                          kv_cache_gib=1, compiled=False, engine_args=engine_args)


def filled(folder, maps) -> EngineSettings:
    return settings(folder, FillSettings("ridge", maps=maps, tail=TAIL))


def stepped(folder, maps) -> EngineSettings:
    """The fill over 128-token steps (chunked prefill beside other requests' decode steps), 8
    requests at once, KV blocks for one request of the longest length test 3 needs (1,536 tokens: 12 attention
    blocks of 128 tokens, one state block for each of the 3 Gated DeltaNet groups, and the null block vLLM 0.32
    holds back = 16; its start-up check refuses fewer); a long batch gets preempted and recomputed."""
    return settings(folder, FillSettings("ridge", maps=maps, tail=TAIL), max_model_len=STEPPED_MAX_LEN,
                    max_num_batched_tokens=128, enable_chunked_prefill=True, max_num_seqs=8,
                    num_gpu_blocks_override=16)


def first_gap(completion, first) -> float:
    """Largest |log p| difference over vLLM's top-k of the first generated token."""
    return max(abs(lp - float(first[t])) for t, lp in completion.top[0].items())


def max_gap(got, want) -> float:
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))


def test_hybrid_tail_covering_the_prompt_is_stock_vllm(vllm_hybrid, engines):
    """Test 1: with tail >= every prompt the plugin fills nothing and runs vLLM's own forward: greedy tokens and
    log-probs identical to stock vLLM (no plugin loaded) on 8 prompts."""
    folder, maps = vllm_hybrid
    batch = prompts(8, [40, 300, 120, 700], vocab_of(folder), seed=1)
    want = engines.get(settings(folder, plugin=False)).generate(batch, 16, logprobs=2)
    worker = engines.get(filled(folder, maps))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 16, logprobs=2, tails=[MAX_LEN] * 8))
    assert counted["filled_rows"] == 0 and counted["full_prompt_rows"] == sum(map(len, batch))
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert max_gap(got, want) == 0.0


def diverge(a, b) -> int:
    """The index of the first token where two completions differ (-1: none)."""
    return next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), -1)


def agree(got, tokens, n: int) -> int:
    """How many completions equal the reference's first n tokens."""
    return sum(c.tokens[:n] == t[:n] for c, t in zip(got, tokens))


def test_hybrid_filled_prefill_matches_ridgefills_engine_in_bf16(vllm_hybrid, engines):
    """Test 2 (and 4: the continuation runs on the recurrent and conv states the filled rows left), against
    ridgefill's engine in bf16 on 8 prompts, at two tails:
    - tail 24 (every row but the first and the last 24 filled): first-token log-probs within BF16_LOGPROB_TOL,
      greedy 4-token continuations equal on at least 7 of 8; over 16 tokens bf16 parts the two implementations even
      without a fill (stock vLLM against the engine's exact prefill: 7 of 8 at 4 tokens, 5 of 8 at 16, measured), so
      there the fill must agree at least as often as exact prefill does, less one;
    - tail 4, where the fill dominates (it moves the first token's log-probs by 0.5-2.3 nats, by > 0.9 on 7 of 8
      prompts, measured): the first token's
      log-probs within FILL_DOMINATED_TOL of the engine's (bf16 against fp32 in the engine alone: up to 0.21), first
      tokens equal on at least 7 of 8. A wrong fill (rows, states, K/V) would miss by about the fill's own effect."""
    folder, maps = vllm_hybrid
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=3)
    worker = engines.get(filled(folder, maps))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 16, logprobs=5))
    assert counted["filled_rows"] == sum(len(p) - TAIL - 1 for p in batch) - counted["outlier_rows_run_full"]
    assert counted["filled_rows"] > 0
    tokens, first = reference(folder, maps, TAIL, batch, 16, dtype="bf16")
    exact_tokens, exact_first = reference(folder, None, TAIL, batch, 16, dtype="bf16")
    stock = engines.get(settings(folder, plugin=False)).generate(batch, 16, logprobs=5)
    gaps = [first_gap(c, f) for c, f in zip(got, first)]
    exact_gaps = [first_gap(c, f) for c, f in zip(stock, exact_first)]
    print(f"qwen3_next bf16 against ridgefill's engine, tail 24: filled: first-token gap {max(gaps):.3f}, "
          f"continuations equal over 1/4/16 tokens {[agree(got, tokens, n) for n in (1, 4, 16)]} of 8; exact (stock "
          f"vLLM): {max(exact_gaps):.3f}, {[agree(stock, exact_tokens, n) for n in (1, 4, 16)]}")
    assert max(gaps) < BF16_LOGPROB_TOL, gaps
    assert agree(got, tokens, 4) >= 7
    assert agree(got, tokens, 16) >= agree(stock, exact_tokens, 16) - 1

    short = worker.generate(batch, 1, logprobs=5, tails=[SHORT_TAIL] * 8)
    tokens, first = reference(folder, maps, SHORT_TAIL, batch, 1, dtype="bf16")
    _, exact_first = reference(folder, None, SHORT_TAIL, batch, 1, dtype="bf16")
    gaps = [first_gap(c, f) for c, f in zip(short, first)]
    moved = [first_gap(c, f) for c, f in zip(short, exact_first)]
    print(f"tail 4: first-token gap {max(gaps):.3f}, first tokens equal {agree(short, tokens, 1)} of 8; the fill's "
          f"own effect {min(moved):.2f}..{max(moved):.2f}")
    assert max(gaps) < FILL_DOMINATED_TOL and agree(short, tokens, 1) >= 7, gaps
    assert sum(m > 2 * FILL_DOMINATED_TOL for m in moved) >= 6  # the fill, not rounding, decides these tokens


def test_hybrid_chunked_batched_and_preempted_requests(vllm_hybrid, engines):
    """Test 3: the fill over 128-token steps (the states carried from step to step) gives exactly what one
    unchunked prefill gives. 8 concurrent mixed requests (some shorter than the tail, one with its own tail) in
    128-token steps with KV blocks for one 1,536-token request, 160 new tokens each (vLLM preempts and recomputes
    some): stock vLLM itself is not batch-invariant on this model in bf16 (measured on these requests: 6 of 8
    decode the same 160 tokens batched as alone, the others part at tokens 39 and 45; with the fill 4 of 8, parting
    at tokens 8, 22, 110 and 116), so every request's first token and its log-probs must be as alone (within
    BF16_LOGPROB_TOL) and its first 4 tokens equal; the counts are printed. Alone, each request runs HELD = 16 tokens
    (what the batch is held to; the 160 are what makes the batch outgrow its KV blocks)."""
    folder, maps = vllm_hybrid
    batch = prompts(8, [900, 20, 800, 48, 1000, 33, 700, 1200], vocab_of(folder), seed=5)
    tails = [None] * 7 + [100]
    whole = engines.get(filled(folder, maps))
    want = [whole.generate([p], HELD, logprobs=1, tails=[t])[0] for p, t in zip(batch, tails)]
    worker = engines.get(stepped(folder, maps))
    alone = [worker.generate([p], HELD, logprobs=1, tails=[t])[0] for p, t in zip(batch, tails)]
    assert [c.tokens for c in alone] == [c.tokens for c in want]
    assert max_gap(alone, want) < BF16_LOGPROB_TOL  # over the first HELD tokens (zip stops there)
    together = worker.generate(batch, NEW, logprobs=1, tails=tails)
    preempted = sum(c.preemptions for c in together)
    first = max(abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(together, alone))
    print(f"qwen3_next bf16: chunked vs whole max log-prob gap {max_gap(alone, want):.3g}; batched vs alone: "
          f"{preempted} preemptions, first-token gap {first:.3g}, first differing token of {HELD} per request "
          f"(-1: none) {[diverge(a, b) for a, b in zip(together, alone)]}")
    assert preempted > 0, "the KV budget did not force a preemption"
    assert [c.tokens[0] for c in together] == [c.tokens[0] for c in alone] and first < BF16_LOGPROB_TOL
    assert agree(together, [c.tokens for c in alone], 4) == 8  # a wrong fill of the prefill shows from the start
