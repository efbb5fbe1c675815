"""`ridgefill bench-ttft --engine vllm`: time to first token inside vLLM, stock vLLM against RidgeFill's plugin.

The same protocol and result document as ridgefill's own engine (evals/bench_ttft.py): per length, every variant
runs `warmup` untimed times, then `repeats` timed runs interleaved, the order rotating each round; median, p90,
a paired bootstrap interval of the speedup, and the FLOP-limit ratio. Here:
- exact is stock vLLM (no plugin loaded); each fill variant is vLLM with the plugin configured (its maps; identity
  fill gets an identity maps file written for the run). Each variant is one engine in its own process
  (serve/vllm_engine.py), all alive for the whole run, built with the same arguments;
- on a GPU the engines split vLLM's memory budget (gpu_memory_utilization 0.85 / variants); never run on one;
- a fill variant that filled no row of prompts with rows to fill is an error (check_filled): it would report
  stock vLLM's timings under the variant's name;
- every variant runs as `ridgefill serve` runs it: vLLM's default compilation (torch.compile; CUDA graphs on a
  GPU) and prefix caching on; each run gets a cache salt of its own, so a repeated prompt never hits the cache
  (the cost of hashing its blocks is still timed). On the CPU vLLM's threads are bound to --threads cores
  (default: all) with none reserved;
- a timed run is one request of the prompt's token ids for one greedy token: the wall time of vLLM's generate
  call in the engine's process (scheduling, prefill, sampling; no tokenization, no IPC). vLLM's own first-token
  latency of the request is kept beside it;
- transformers' forward is not timed (exact_vs_transformers is null) and the fill projection is not timed apart.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from ridgefill.errors import RidgefillError
from ridgefill.runtime.stats import ratio_of_medians
from ridgefill.runtime.console import progress_bar
from ridgefill.runtime.models import model_folder
from ridgefill.method.fill import FillSettings
from ridgefill.serve.vllm_config import check_engine_dtype
from ridgefill.serve.vllm_engine import EngineSettings, VllmWorker, vllm_dtype

KV_CACHE_GIB = 2


def bench_lengths(m, prompts: dict, add_flops, scratch: Path) -> tuple[list[dict], dict, dict]:
    """Every length's timings and speedups (FLOPs added by `add_flops(entry, plans, names, length)`), their
    intervals, and the engines' settings and fill tallies."""
    c = m.config
    check_engine_dtype(model_folder(c.model), c.dtype)
    names = list(m.plans)
    fills = names[1:]
    longest = max(len(ids[0]) for ids, _ in prompts.values())
    threads = c.threads or os.cpu_count() or 1
    args = {"max_num_batched_tokens": max(c.chunk, 256), "enable_chunked_prefill": True}
    if torch.cuda.is_available():  # the engines share one GPU: split vLLM's memory budget between them
        args["gpu_memory_utilization"] = round(0.85 / len(names), 3)
    # vLLM wants room for the generated token (prompt + 1 <= max_model_len); a prompt of the model's whole context
    # computes no position past it, so the longer limit is allowed for the run (VLLM_ALLOW_LONG_MAX_MODEL_LEN)
    context = m.session.context_length
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if context and longest + 1 > context else {}
    settings = {name: EngineSettings(model_folder(c.model), _fill(m, name, scratch), plugin=name != "exact",
                                     dtype=vllm_dtype(c.dtype), max_model_len=longest + 8,
                                     threads=f"0-{threads - 1}", kv_cache_gib=KV_CACHE_GIB, engine_args=args,
                                     env=env)
                for name in names}
    results, intervals = [], {"speedup": {v: {} for v in fills}, "exact_vs_transformers": {}}
    runs = len(prompts) * len(names) * (c.warmup + c.repeats)
    with ExitStack() as stack, progress_bar("timing vLLM prefill to first token", runs) as advance:
        workers = {name: stack.enter_context(VllmWorker(s)) for name, s in settings.items()}
        for length, (ids, source) in prompts.items():
            entry = {"length": length, "prompt": source,
                     **_bench_length(workers, m.plans, ids[0].tolist(), c.repeats, c.warmup, c.seed, advance)}
            add_flops(entry, m.plans, fills, length)
            for v in fills:
                intervals["speedup"][v][str(length)] = entry["fill"][v]["speedup_interval"]
            intervals["exact_vs_transformers"][str(length)] = None
            results.append(entry)
        tallies = {name: workers[name].tally() for name in fills}
    for name, tally in tallies.items():  # what vLLM filled, counted where the result document reads it
        planned = (c.warmup + c.repeats) * sum(entry["fill"][name]["filled_rows"] for entry in results)
        check_filled(name, tally, planned)
        m.plans[name].tally.filled += tally["filled_rows"]
        m.plans[name].tally.outliers += tally["outlier_rows_run_full"]
        m.plans[name].tally.unwindowed += tally["lookback_rows_run_full"]
    engines = {name: {"plugin": s.plugin, "fill": s.fill.describe() if s.fill else None, "dtype": s.dtype,
                      "threads_bind": s.threads, "max_model_len": s.max_model_len, **s.engine_args,
                      "enforce_eager": not s.compiled, "enable_prefix_caching": s.enable_prefix_caching, "env": s.env,
                      **({"tally": tallies[name]} if name in tallies else {})}
               for name, s in settings.items()}
    return results, intervals, engines


def check_filled(name: str, tally: dict, planned: int) -> None:
    """Refuse timings of a fill variant that filled no row although its prompts had rows to fill: it timed stock
    vLLM under the variant's name (the plugin did not run)."""
    if planned > 0 and tally["filled_rows"] == 0:
        raise RidgefillError(f"{name} filled none of the {planned} prompt rows it should have filled in vLLM "
                             f"({tally['full_prompt_rows']} ran in full, {tally['stock_steps']} steps ran stock): "
                             "its timings are stock vLLM's, so none are reported; check that ridgefill's vLLM plugin "
                             "loads (VLLM_PLUGINS, VLLM_USE_V2_MODEL_RUNNER)")


def _fill(m, name: str, scratch: Path) -> FillSettings | None:
    """The plugin's configuration of variant `name` (None: stock vLLM)."""
    if name == "exact":
        return None
    c = m.config
    fill = FillSettings(name, m.split, c.maps if name == "ridge" else None, c.tail, c.keep_first, c.outlier_factor,
                        filled_window=c.filled_window, filled_window_layers=c.filled_window_layers)
    return fill.for_vllm(m.session.engine.n_layers, m.session.loaded.info(), scratch)


def _bench_length(workers: dict, plans: dict, ids: list[int], repeats: int, warmup: int, seed: int,
                  advance) -> dict:
    names = list(workers)
    samples = {name: [] for name in names}
    latency = {name: [] for name in names}
    tokens = {}
    for w in range(warmup):
        for name in names:
            workers[name].generate([ids], 1, cache_salt=f"ridgefill-bench:{len(ids)}:warmup{w}")
            advance()
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no variant always runs first
            (done,) = workers[name].generate([ids], 1, cache_salt=f"ridgefill-bench:{len(ids)}:{r}")
            samples[name].append(done.seconds)
            latency[name].append(done.first_token_s)
            tokens[name] = done.tokens[0]
            advance()
    n = len(ids)
    fill = {}
    for name in names[1:]:
        iv = ratio_of_medians(samples["exact"], samples[name], seed=seed)
        fill[name] = {"speedup": iv.estimate, "speedup_interval": iv.to_dict(),
                      "filled_rows": int((~plans[name].full_rows(n)).sum()),
                      "projection_s": None, "projection_share": None, "instrumented_run_s": None}
    head = names[-1]
    return {"headline_variant": head, "speedup": fill[head]["speedup"],
            "timings": {name: _summary(samples[name], latency[name], n) for name in names}, "fill": fill,
            "exact_vs_transformers": None, "first_token": tokens}


def _summary(samples: list[float], latency: list[float | None], n: int) -> dict:
    median = float(np.median(samples))
    known = [x for x in latency if x is not None]
    return {"median_s": median, "p90_s": float(np.percentile(samples, 90)), "min_s": float(min(samples)),
            "tokens_per_s": n / median, "samples_s": list(samples),
            "vllm_first_token_latency_median_s": float(np.median(known)) if known else None,
            "peak_memory_bytes": None, "peak_increase_bytes": None}


def scratch_folder():
    """A temporary folder for the run's identity maps file."""
    return tempfile.TemporaryDirectory(prefix="ridgefill-vllm-")
