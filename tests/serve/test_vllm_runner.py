"""The runner hook's step plan (serve/vllm_runner.plan_step) on a stand-in for vLLM's model runner: the fields of
V1's GPUModelRunner / InputBatch it reads, as numpy arrays (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ridgefill.serve.vllm_runner import plan_step


def runner(prompts, computed, scheduled, with_query_start=True):
    """A runner whose requests have `prompts` prompt tokens, `computed` tokens computed before this step and
    `scheduled` tokens in it; sampling parameters None (a request that is no sampling request runs exact)."""
    batch = SimpleNamespace(num_reqs=len(prompts), req_ids=[f"r{i}" for i in range(len(prompts))],
                            num_prompt_tokens=np.array(prompts, dtype=np.int32),
                            num_computed_tokens_cpu=np.array(computed, dtype=np.int32))
    r = SimpleNamespace(input_batch=batch, requests={})
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
