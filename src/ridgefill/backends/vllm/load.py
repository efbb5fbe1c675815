"""bench-serve's load through vLLM's own benchmark client (vllm.benchmarks.serve.benchmark): a seeded Poisson request
stream against an OpenAI-compatible server (VllmBackend.drive)."""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from ridgefill.backends.load import bounded, check_failures


def drive(base: str, model: str, tokenizer, prompts: list[list[int]], rate: float, output_tokens: int, seed: int,
          time_limit: float, salt: str = "") -> list:
    """The request stream at `rate` through vLLM's benchmark client: its per-request outputs (RequestFuncOutput).
    Seeded: the same arrivals for every variant. vLLM's client prints on stderr."""
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    requests = [SampleRequest(prompt=p, prompt_len=len(p), expected_output_len=output_tokens,
                              request_overrides={"cache_salt": f"ridgefill-bench-serve:{salt}{rate}:{i}"})
                for i, p in enumerate(prompts)]
    np.random.seed(seed)  # the client draws the Poisson arrivals from numpy's global generator
    run = benchmark(task_type=TaskType.GENERATION, endpoint_type="openai", api_url=f"{base}/v1/completions",
                    base_url=base, model_id=model, model_name=model, tokenizer=tokenizer, input_requests=requests,
                    logprobs=None, request_rate=rate, burstiness=1.0, disable_tqdm=True, num_warmups=0,
                    profile=False, selected_percentile_metrics=["ttft"], selected_percentiles=[50.0],
                    ignore_eos=True, goodput_config_dict={}, max_concurrency=None, lora_modules=None,
                    extra_headers=None, extra_body={"temperature": 0.0}, ready_check_timeout_sec=0)
    with contextlib.redirect_stdout(sys.stderr):
        result = bounded(run, rate, time_limit)
    check_failures(result["errors"], rate)
    return [{"ttft": t, "latency": lat, "output_tokens": n, "start": s}
            for t, lat, n, s in zip(result["ttfts"], result["latencies"], result["output_lens"],
                                    result["start_times"])]
