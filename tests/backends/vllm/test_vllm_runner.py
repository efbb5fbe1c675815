"""The runner hook's step plan (backends/vllm/plugin/runner.plan_step) on a stand-in for vLLM's model runner: the fields of
V1's GPUModelRunner / InputBatch it reads, as numpy arrays (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ridgefill.backends.counters import FillCounters
from ridgefill.backends.vllm.plugin.runner import StepLog, account, max_runs, plan_step


def config(max_num_seqs=256, mode="NONE", capture=None):
    """The fields of vLLM's VllmConfig the run bound reads."""
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                           compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode),
                                                              max_cudagraph_capture_size=capture))


def runner(prompts, computed, scheduled, with_query_start=True, sampling=False, vllm_config=None,
           ids=None):
    """A runner whose requests have `prompts` prompt tokens, `computed` tokens computed before this step and
    `scheduled` tokens in it; sampling parameters None (a request that is no sampling request runs exact), or
    sampling requests without options of their own (`sampling`: the served tail and keep-first)."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    batch = SimpleNamespace(num_reqs=len(prompts), req_ids=ids, num_prompt_tokens=np.array(prompts, dtype=np.int32),
                            num_computed_tokens_cpu=np.array(computed, dtype=np.int32))
    params = SimpleNamespace(prompt_logprobs=None, extra_args=None)
    requests = {i: SimpleNamespace(sampling_params=params) for i in ids} if sampling else {}
    r = SimpleNamespace(input_batch=batch, requests=requests, vllm_config=vllm_config or config())
    if with_query_start:
        r.query_start_loc = SimpleNamespace(np=np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32))
    return r


def positions_of(computed, scheduled, pad=0):
    return torch.cat([torch.arange(c, c + n) for c, n in zip(computed, scheduled)] + [torch.zeros(pad, dtype=torch.long)])


def test_a_decode_step_is_planned_from_the_request_counts_alone():
    """Every prompt computed: no step to plan, decided before any per-token work (the stand-in has no
    query_start_loc, which the per-token plan reads: the hook returns first)."""
    computed, scheduled = [300, 41, 700], [1, 1, 1]
    r = runner([300, 40, 512], computed, scheduled, with_query_start=False)
    assert plan_step(r, positions_of(computed, scheduled, pad=5), served_tail=16, served_keep=1) is None


def test_a_step_with_prompt_tokens_is_planned_per_token():
    """One request decoding, one in the middle of its prompt: the step is planned, its prompt tokens are the second
    request's, and that request runs exact (no sampling parameters: tail = its prompt)."""
    computed, scheduled = [300, 128], [1, 128]
    r = runner([300, 512], computed, scheduled)
    step = plan_step(r, positions_of(computed, scheduled, pad=3), served_tail=16, served_keep=1)
    assert step is not None and step.req_ids == ["r0", "r1"]
    assert step.in_prompt.tolist() == [False] + [True] * 128 + [False] * 3
    assert step.tails == [300, 512] and not bool(step.last.any())
    assert bool(step.full[1:129].all())


def test_the_run_bound_is_max_num_seqs_or_the_cuda_graph_capture_size_where_graphs_run():
    assert max_runs(SimpleNamespace(vllm_config=config(256))) == 256
    assert max_runs(SimpleNamespace(vllm_config=config(256, "FULL_AND_PIECEWISE", 64))) == 64
    assert max_runs(SimpleNamespace(vllm_config=config(16, "PIECEWISE", 512))) == 16
    assert max_runs(SimpleNamespace(vllm_config=config(256, "NONE", 8))) == 256  # no graphs: capture size unused


def test_a_step_with_more_runs_than_max_num_seqs_runs_the_shortest_gaps_in_full():
    """Three 100-200 token prompts in one step (served tail 16, keep-first 1: two runs each) with max_num_seqs 4.
    The plan leaves the rule's rows as they are and carries the bound; the model's FillBatch applies it once, to
    the full rows and those it adds: the two shortest filled stretches (83 and 133 rows) run in full, so the step
    has 4 runs. With an outlier row inside request 1's stretch (7 runs) the three shortest gaps close: 49, 83 and
    the earlier of the two 133s (request 1's)."""
    prompts = [100, 200, 150]
    r = runner(prompts, [0, 0, 0], prompts, sampling=True, vllm_config=config(4))
    step = plan_step(r, positions_of([0, 0, 0], prompts), served_tail=16, served_keep=1)
    assert step.max_runs == 4
    assert int((~step.full).sum()) == 83 + 183 + 133  # the plan itself is unbounded
    batch = step.batch(SimpleNamespace(attn_groups=[]))
    assert batch.max_runs == 4
    bounded = batch.bounded(step.full)
    assert bounded[:100].all() and bounded[300:].all()  # requests 0 and 2: exact
    assert int((~bounded[100:300]).sum()) == 200 - 16 - 1  # request 1: filled as the rule says
    assert int(batch.promoted.sum()) == 83 + 133 and not (batch.promoted & step.full).any()
    outlier = step.full.clone()
    outlier[150] = True  # an outlier row the model adds inside request 1's filled stretch: 7 runs
    bounded = batch.bounded(outlier)
    assert bounded[:300].all() and int((~bounded[300:]).sum()) == 133  # request 2 keeps its stretch
    assert int(batch.promoted.sum()) == 49 + 83 + 133
    roomy = plan_step(runner(prompts, [0, 0, 0], prompts, sampling=True), positions_of([0, 0, 0], prompts), 16, 1)
    roomy_batch = roomy.batch(SimpleNamespace(attn_groups=[]))
    assert roomy_batch.max_runs <= 0 or roomy_batch.max_runs >= 6
    assert torch.equal(roomy_batch.bounded(roomy.full), roomy.full) and not roomy_batch.promoted.any()


class Counted:
    def __init__(self):
        self.counters = FillCounters()

    def count(self, **added):
        self.counters.count(**added)


def run_step(state, book, r, computed, scheduled, live=None):
    """Plan one step of the stand-in runner and account it as if the model filled every row the rule fills."""
    step = plan_step(r, positions_of(computed, scheduled), served_tail=8, served_keep=1)
    filled = step.in_prompt & ~step.full
    account(state, step, SimpleNamespace(filled=filled, outliers=None, unwindowed=None), book, live)
    return step


def test_every_prompt_token_is_counted_once_through_cache_hits_chunks_and_preemption():
    """A 100-token prompt whose first 32 tokens came from the prefix cache, computed in chunks of 40 and 28, then
    preempted after 3 generated tokens and recomputed from position 16 (its first 16 tokens still cached) with the
    3 generated tokens: 32 tokens cached, 60 filled and 8 full once; the 84 prompt tokens computed again are
    `recomputed` only."""
    state, book = Counted(), StepLog()
    for computed, scheduled in ((32, 40), (72, 28)):
        run_step(state, book, runner([100], [computed], [scheduled], sampling=True), [computed], [scheduled])
    first = dict(state.counters.totals)
    assert (first["cached_prompt_tokens"], first["filled_tokens"], first["full_tokens"]) == (32, 60, 8)
    assert first["recomputed_prompt_tokens"] == 0
    run_step(state, book, runner([100], [16], [87], sampling=True), [16], [87], live={"r0"})  # the recomputation
    again = state.counters.totals
    assert again["recomputed_prompt_tokens"] == 84
    once = ("filled_tokens", "full_tokens", "cached_prompt_tokens")
    assert {k: again[k] for k in once} == {k: first[k] for k in once}
    assert again["filled_tokens"] + again["full_tokens"] + again["cached_prompt_tokens"] == 100


def test_finished_requests_are_forgotten_and_each_counted_once():
    state, book = Counted(), StepLog()
    for n in range(300):  # 300 finished one-step requests: the log keeps at most 2 x live + 256 of them
        ids = [f"q{n}"]
        run_step(state, book, runner([20], [0], [20], sampling=True, ids=ids), [0], [20], live=set(ids))
    assert len(book.requests) <= 2 + 256 + 1 and state.counters.totals["recomputed_prompt_tokens"] == 0
    assert state.counters.totals["filled_tokens"] + state.counters.totals["full_tokens"] == 300 * 20


def test_a_request_keep_first_past_its_prompt_runs_it_exact_as_the_engine_does():
    """The plugin's rule for a request's own keep-first past its prompt: the whole prompt in full (exact), the
    rows torchfill runs in full for that keep-first."""
    from ridgefill.torchfill import FillPlan, IdentityFiller

    prompts = [60, 40]
    r = runner(prompts, [0, 0], prompts, sampling=True)
    r.requests["r1"].sampling_params = SimpleNamespace(prompt_logprobs=None, extra_args={"ridgefill_keep_first": 10**9})
    step = plan_step(r, positions_of([0, 0], prompts), served_tail=8, served_keep=1)
    assert step.keeps == [1, 40] and step.full[60:].all()
    for i, (a, b) in enumerate(((0, 60), (60, 100))):
        plan = FillPlan(IdentityFiller(2, 6), 8, keep_first=[1, 10**9][i])
        assert step.full[a:b].tolist() == plan.full_rows(b - a).tolist()
