"""RidgeFill inside vLLM on a hybrid model (Qwen3-Next: Gated DeltaNet layers between gated full-attention
layers, MoE MLPs), in bf16, the only dtype of vLLM's CPU Gated DeltaNet kernel. A tiny random-init checkpoint
(vllm_fixtures.vllm_hybrid) against stock vLLM and against torchfill in bf16.

The tolerances are bf16's, measured (issue 39, 2026-12-04). What the two fill is the same: after the prompt, vLLM's
conv and recurrent states (read from its GDN caches) and torchfill's in bf16 are as far from torchfill's fp32
states as each other, in every linear layer, filled (4-6) or not (0-2): relative errors 0.2-5 %, the ratio vLLM /
torchfill 0.8-1.3 on all 8 prompts of test 2 at tail 24. The log-prob gaps are bf16 rounding compounding over the
layers and steps: vLLM against torchfill teacher-forced (`forced`) is as far apart with exact prefill as with the
fill, and the greedy continuations part only at near-ties (vLLM's top-2 gap there at most 0.19 nats, while bf16
moves log-probs by up to 0.4). So test 2 bounds log-prob gaps on one token path instead of counting equal greedy
tokens, each bar about 1.5 times the largest gap measured over many prompt sets (test 2 lists them).
"""

from __future__ import annotations

import pytest

from ridgefill.method.fill import FillSettings
from ridgefill.backends.vllm.worker import WorkerSettings
from vllm_fixtures import (assert_parts_only_at_near_ties, gap_before_parting, prompts, tally_delta, top2_gap,
                           vocab_of)

pytest.importorskip("vllm")

MAX_LEN = 2048
NEW = 160  # tokens generated per request in test 3 (long enough that running requests outgrow the KV budget)
HELD = 16  # test 3: the tokens of each batched request checked against the same request run alone
STEPPED_MAX_LEN = 1536  # test 3's worker: its longest request is 1,200 + 160 tokens
TAIL = 24
SHORT_TAIL = 4  # test 2: the last rows see the filled rows' K/V and states closely (with 24 the states forget them)
BF16_LOGPROB_TOL = 0.35  # nats, test 3: first-token top-5 (bf16: torchfill vs its fp32 0.28, vLLM vs torchfill 0.29)
FORCED_STEPS = 8  # test 2 at tail 24: the teacher-forced steps compared (bf16's gaps grow past them: see test 2)
FORCED_TOL = 1.0  # nats, test 2 at tail 24: top-5 log-probs over FORCED_STEPS steps (largest measured 0.68)
FILL_DOMINATED_TOL = 0.6  # nats, test 2 at tail 4: the first token's top-5 log-probs (largest measured 0.40)
NEAR_TIE = 0.2  # nats, test 3: a reference's top-2 gap under which bf16 arithmetic that is not invariant (batching,
# chunking) may swap its two top tokens: one batched request's first token swapped at a gap of 0.0655 on an Intel Xeon
# (AVX-512), not on an AMD EPYC; where test 2's bf16 continuations part, vLLM's top-2 gap was at most 0.19


def settings(folder, fill: FillSettings | None = None, plugin: bool = True, max_model_len: int = MAX_LEN,
             **llm_args) -> WorkerSettings:
    """A worker as `ridgefill serve` runs a hybrid: bf16, prefix caching off (vllm_config.PREFIX_CACHING_HYBRID);
    eager (compiling costs minutes here)."""
    return WorkerSettings(str(folder), fill, plugin=plugin, dtype="bfloat16", max_model_len=max_model_len,
                          kv_cache_gib=1, compiled=False, llm_args=llm_args)


def filled(folder, maps) -> WorkerSettings:
    return settings(folder, FillSettings("ridge", maps=maps, tail=TAIL))


def stepped(folder, maps) -> WorkerSettings:
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


def test_hybrid_tail_covering_the_prompt_is_stock_vllm(vllm_hybrid, workers):
    """Test 1: with tail >= every prompt the plugin fills nothing and runs vLLM's own forward: greedy tokens and
    log-probs identical to stock vLLM (no plugin loaded) on 8 prompts."""
    folder, maps = vllm_hybrid
    batch = prompts(8, [40, 300, 120, 700], vocab_of(folder), seed=1)
    want = workers.get(settings(folder, plugin=False)).generate(batch, 16, logprobs=2)
    worker = workers.get(filled(folder, maps))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 16, logprobs=2, tails=[MAX_LEN] * 8))
    assert counted["filled_tokens"] == 0 and counted["full_tokens"] == sum(map(len, batch))
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert max_gap(got, want) == 0.0


def forced(folder, maps, tail: int, batch: list[list[int]], completions) -> list:
    """torchfill in bf16 (maps None: exact prefill) teacher-forced on each vLLM completion's tokens: per
    completion its log-probs [k, V], row t the distribution token t was drawn from. Both implementations are read on
    one token path, so a near-tie that bf16 breaks one way in vLLM and the other in torchfill cannot end the
    comparison (greedy continuations part there and are no longer comparable)."""
    import torch

    from ridgefill.runtime.session import open_session

    session = open_session(str(folder), chunk=2048, dtype="bf16")
    plan = None if maps is None else FillSettings("ridge", maps=maps, tail=tail).plan(session)[0]
    out = []
    with torch.inference_mode():
        for prompt, completion in zip(batch, completions):
            pre = session.runner.prefill(torch.tensor([prompt]), plan, capacity=len(prompt) + len(completion.tokens))
            rows = [pre.logits[0, -1]]
            rows += [session.runner.decode_step(pre.cache, torch.tensor([t]))[0] for t in completion.tokens[:-1]]
            out.append(torch.log_softmax(torch.stack(rows).double(), -1))
    return out


def forced_gap(completion, logprobs) -> float:
    """Largest |log p| difference between a vLLM completion's top-k and torchfill's teacher-forced log-probs
    [k, V], over every step."""
    return max(abs(lp - float(logprobs[s, t])) for s, top in enumerate(completion.top) for t, lp in top.items())


def parting(completion, logprobs) -> int:
    """The first step where torchfill's teacher-forced argmax is not vLLM's greedy token (-1: none), i.e. where
    the two greedy continuations would part."""
    return next((s for s, t in enumerate(completion.tokens) if int(logprobs[s].argmax()) != t), -1)


def test_hybrid_filled_prefill_matches_torchfill_in_bf16(vllm_hybrid, workers):
    """Test 2 (and 4: the continuation runs on the recurrent and conv states the filled rows left), against
    torchfill in bf16 on 8 prompts (seed 3), torchfill teacher-forced on vLLM's greedy tokens (`forced`):
    - tail 24 (every row but the first and the last 24 filled): vLLM's top-5 log-probs at each of FORCED_STEPS
      steps within FORCED_TOL of torchfill's;
    - tail 4, where the fill dominates: the first token's top-5 log-probs within FILL_DOMINATED_TOL of torchfill's,
      and the fill moves them (against torchfill's exact prefill) by more than that on at least 6 of 8 prompts
      (measured: 8, by 0.99-2.20 nats), so a wrong fill (rows, states, K/V) would miss by about its own effect.
    Greedy tokens are only printed. Measured on the 8-prompt sets of other seeds, the largest gap of each set
    (issue 39, this CPU; seed 3 gives the same numbers run to run):
    - tail 4, first token, seeds 0, 3, 10-29 (176 prompts): 0.12-0.40 (median prompt 0.11); the first tokens differ
      on 11 of 176 prompts, each where vLLM's top-2 gap is at most 0.19, so "7 of 8 equal" fails for ~8 % of sets;
    - tail 24, seeds 0, 3, 10-16 (72 prompts): over 8 steps 0.25-0.68 (0.68: seed 12, a low-ranked token one step
      after a near-tie; the others at most 0.46), over 16 steps 0.30-0.68; exact prefill (stock vLLM against the
      torchfill's), seeds 0, 10, 11: over 8 steps 0.22-0.25, over 16 steps 0.38-0.84 (bf16 compounds over the steps,
      fill or not: hence FORCED_STEPS); four-token greedy continuations equal on 6, 7, 7, 7, 5, 5, 6, 8, 7 of 8 (four
      sets fail the old "at least 7", as issue 39's clean clone did), every parting at a top-2 gap of at most 0.19.
    A fill that feeds late linear layers the split state instead of the prediction (tried in vllm_model.py) fails
    here: tail 4 gap 2.66 (tail 24: 0.42)."""
    folder, maps = vllm_hybrid
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=3)
    worker = workers.get(filled(folder, maps))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, FORCED_STEPS, logprobs=5))
    assert counted["filled_tokens"] == sum(len(p) - TAIL - 1 for p in batch) - counted["outlier_tokens"]
    assert counted["filled_tokens"] > 0
    stock = workers.get(settings(folder, plugin=False)).generate(batch, FORCED_STEPS, logprobs=5)
    fill_lp, exact_lp = forced(folder, maps, TAIL, batch, got), forced(folder, None, TAIL, batch, stock)
    gaps = [forced_gap(c, lp) for c, lp in zip(got, fill_lp)]
    exact_gaps = [forced_gap(c, lp) for c, lp in zip(stock, exact_lp)]
    print(f"qwen3_next bf16 against torchfill teacher-forced over {FORCED_STEPS} steps, tail 24: filled: "
          f"largest gap {max(gaps):.3f}, greedy would part at {[parting(c, lp) for c, lp in zip(got, fill_lp)]}; "
          f"exact (stock vLLM): {max(exact_gaps):.3f}, {[parting(c, lp) for c, lp in zip(stock, exact_lp)]}")
    assert max(gaps) < FORCED_TOL, gaps

    short = worker.generate(batch, 1, logprobs=5, tails=[SHORT_TAIL] * 8)
    gaps = [forced_gap(c, lp) for c, lp in zip(short, forced(folder, maps, SHORT_TAIL, batch, short))]
    moved = [first_gap(c, lp[0]) for c, lp in zip(short, exact_lp)]  # against torchfill's exact prefill
    print(f"tail 4: first-token gap {max(gaps):.3f}; the fill's own effect {min(moved):.2f}..{max(moved):.2f}")
    assert max(gaps) < FILL_DOMINATED_TOL, gaps
    assert sum(m > FILL_DOMINATED_TOL for m in moved) >= 6  # the fill, not rounding, decides these tokens


def test_hybrid_chunked_batched_and_preempted_requests(vllm_hybrid, workers):
    """Test 3: the fill over 128-token steps (the states carried from step to step) gives exactly what one
    unchunked prefill gives. 8 concurrent mixed requests (some shorter than the tail, one with its own tail) in
    128-token steps with KV blocks for one 1,536-token request, 160 new tokens each (vLLM preempts and recomputes
    some): stock vLLM itself is not batch-invariant on this model in bf16 (measured on these requests: 6 of 8
    decode the same 160 tokens batched as alone, the others part at tokens 39 and 45; with the fill 4 of 8, parting
    at tokens 8, 22, 110 and 116; on an Intel Xeon one request's first token swapped at a top-2 gap of 0.0655). So
    over the first HELD = 16 tokens each request, chunked against whole and batched against alone, equals its
    reference or parts from it only at a near tie of the reference (NEAR_TIE), and its chosen tokens' log-probs before
    it parts are within BF16_LOGPROB_TOL; the partings are printed (measured on an AMD EPYC: chunked equal to whole on
    all 8; batched, one request parts at token 8 where alone's two best were 0.0625 apart). A wrong fill of the
    prefill shows from the start, far from a tie. Alone, each request runs HELD tokens (what the batch is held to;
    the 160 are what makes the batch outgrow its KV blocks)."""
    folder, maps = vllm_hybrid
    batch = prompts(8, [900, 20, 800, 48, 1000, 33, 700, 1200], vocab_of(folder), seed=5)
    tails = [None] * 7 + [100]
    whole = workers.get(filled(folder, maps))
    want = [whole.generate([p], HELD, logprobs=5, tails=[t])[0] for p, t in zip(batch, tails)]
    worker = workers.get(stepped(folder, maps))
    alone = [worker.generate([p], HELD, logprobs=5, tails=[t])[0] for p, t in zip(batch, tails)]
    chunked = assert_parts_only_at_near_ties("chunked vs whole", alone, want, NEAR_TIE)
    together = worker.generate(batch, NEW, logprobs=1, tails=tails)
    preempted = sum(c.preemptions for c in together)
    batched = assert_parts_only_at_near_ties("batched vs alone", together, alone, NEAR_TIE)  # the first HELD tokens
    print(f"qwen3_next bf16: chunked vs whole: log-prob gap {gap_before_parting(alone, want):.3g}, partings "
          f"(step, gap) {chunked}; batched vs alone: {preempted} preemptions, log-prob gap "
          f"{gap_before_parting(together, alone):.3g}, partings {batched}; the first-token top-2 gaps alone "
          f"{[round(top2_gap(w), 3) for w in alone]}")
    assert preempted > 0, "the KV budget did not force a preemption"
    assert gap_before_parting(alone, want) < BF16_LOGPROB_TOL and gap_before_parting(together, alone) < BF16_LOGPROB_TOL
    # most first tokens are no near tie (measured: 5 of 8, 0.34-1.47 nats; the others 0.0-0.125), so the check bites
    assert sum(top2_gap(w) >= NEAR_TIE for w in alone) >= 4
