"""`ridgefill bench-ttft`: time to first token of exact against filled prefill, and the FLOP count that bounds
the speedup.

A timed run is the whole path from prompt token ids to the first generated token: the engine's prefill
(maps applied, caches written) and the greedy choice of the first token (`--engine` picks the engine: each
backend's `first_token`, backends/). Per length, every variant runs `warmup` untimed times, then `repeats` timed
runs interleaved run by run, the order rotating each round (backends/base.time_first_tokens, the one loop for every
engine). With torchfill (backends/torchfill.py) transformers' own forward (model(ids, use_cache=True),
logits of the last row only) runs on the same prompt in the same rounds, on CUDA each run is synchronised before
the clock stops, and one more run of each fill variant, on an engine whose fill projection is timed (a
Stopwatch), gives the projection's share of a filled prefill. vLLM's runs: backends/vllm/backend.py.

The FLOP count (evals/flops.py) gives each variant's FLOPs; the limit speedup is exact FLOPs over filled FLOPs,
and `achieved_over_limit` is the measured speedup over that limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ridgefill.backends.base import REFERENCE as TRANSFORMERS, Backend, EngineOptions, time_first_tokens
from ridgefill.commands import Command, option
from ridgefill.torchfill import PROJECTION_KERNELS, ModelShape
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import MeasureConfig, Measurement, parse_lengths, start
from ridgefill.evals.flops import prefill_flops
from ridgefill.runtime.stats import format_interval, mean, ratio_of_medians
from ridgefill.method.fill import ServedOptions, Tuned, load_serving, parse_variants
from ridgefill.runtime.console import note, progress_bar, table
from ridgefill.runtime.data import documents_for, load_corpus, passages, token_sequences
from ridgefill.runtime.provenance import cpu_name, device_info, load_average, versions
from ridgefill.runtime.session import check_length



# --- options -------------------------------------------------------------------------------------------
@dataclass
class BenchConfig(EngineOptions, MeasureConfig, ServedOptions):
    seed: int = option(0, "Seed of random prompts and bootstrap intervals.", top="seeds")
    out: Path = option(Path("ttft.json"), "Result JSON (raw samples included).", role="output")
    lengths: str = option("1024,2048,4096,8192", "Prompt lengths (tokens), comma-separated.", listed=int)
    repeats: int = option(5, "Timed runs of each variant per length (interleaved).")
    warmup: int = option(1, "Untimed runs of each variant per length, first.")
    variants: str | None = option(None, "exact plus identity and/or ridge (default: all that the options allow).",
                                  listed=str)
    data: str = option("wiki-leads", "Prompt text (evaluation documents), or 'random' ids.", fallback="data")
    threads: int = option(0, "torch CPU threads (0: torch's default).")
    projection: str = option("auto", "Fill projection: auto or torch (all late layers' K/V in one batched "
                             "GEMM), or layers (per layer, unfused).")

    def check(self) -> None:
        super().check()
        self.names()
        self.sizes()
        if self.repeats < 1 or self.warmup < 0:
            raise RidgefillError(f"--repeats must be >= 1 and --warmup >= 0 (got {self.repeats}, {self.warmup})")
        if self.projection not in PROJECTION_KERNELS:
            raise RidgefillError(f"unknown --projection '{self.projection}': use one of "
                                 f"{', '.join(PROJECTION_KERNELS)}")
        if self.threads < 0:
            raise RidgefillError(f"--threads must be >= 0 (0 keeps torch's default), got {self.threads}")

    def source_rule(self):
        return ("variants",), None

    def names(self) -> list[str]:
        """The variants timed, exact first."""
        names = parse_variants(self.variants, self.maps)
        if len(names) < 2:
            raise RidgefillError("--variants needs at least one of identity, ridge besides exact (the speedup is "
                                 "exact time over filled time)")
        return names

    def sizes(self) -> list[int]:
        return parse_lengths(self.lengths, minimum=2)

    def record(self) -> dict:
        """The result document's `config` (the lengths and variants as parsed, the threads torch runs on)."""
        return {"model": self.model, "maps": str(self.maps) if self.maps else None, "split": self.split,
                "tail": self.tail, "lengths": self.sizes(), "repeats": self.repeats, "warmup": self.warmup,
                "device": self.device, "dtype": self.dtype, "variants": self.names(), "data": self.data,
                "keep_first": self.keep_first, "chunk": self.chunk, "threads": torch.get_num_threads(),
                "projection": self.projection, "out": str(self.out), "engine": self.engine,
                "serving_config": str(self.serving_config) if self.serving_config else None}


# --- the command ---------------------------------------------------------------------------------------
def served(c: BenchConfig) -> tuple[BenchConfig, Tuned | None]:
    """The config with a serving config's fill in place of the fill options and --variants (exact and the tuned
    fill)."""
    if c.serving_config is None:
        return c, None
    tuned = load_serving(c.serving_config)
    return c.with_serving(tuned, variants=f"exact,{tuned.fill.variant}"), tuned


def run(config: BenchConfig) -> dict:
    c, serving = served(config)
    if c.threads:
        torch.set_num_threads(c.threads)
    load_before = _load_1m()
    m = start("bench-ttft", c, c.names(), record=c.record(), projection=c.projection)
    if serving is not None:
        serving.check_model(m.model.fingerprint, c.serving_config)
    _check_model(m, c.sizes()[-1])
    prompts = _prompts(m.model, c.data, c.sizes(), c.seed)
    longest = max(ids.shape[1] for ids, _ in prompts.values())
    with m.backend.start(longest + 8):
        results, intervals = _bench_lengths(m, prompts, m.model.shape)
        memory = _map_memory(m)
        for entry in results:
            entry["map_bytes"] = memory["map_bytes"]
        doc = m.write(results, intervals, split=m.split, map_memory=memory,
                      device=_device_info(m.backend, load_before), versions=versions())
    _print(doc, c.out, m.backend.title)
    return doc


def _check_model(m: Measurement, longest: int) -> None:
    """What needs the model: the longest prompt fits its context."""
    limit = m.model.context_length
    check_length("--lengths", longest, limit, f"use lengths up to {limit}")


COMMAND = Command("bench-ttft", BenchConfig, run, writes=".json", reads="maps")


def _bench_lengths(m: Measurement, prompts: dict, shape: ModelShape | None) -> tuple[list[dict], dict]:
    """Every length's timings, speedups and FLOPs (shape None: no FLOP count), and the speedups' intervals."""
    c, backend = m.config, m.backend
    fill_names = list(m.plans)[1:]  # after exact
    results, intervals = [], {"speedup": {v: {} for v in fill_names}, "exact_vs_transformers": {}}
    timed = [TRANSFORMERS, *m.plans] if backend.caps.reference_forward else list(m.plans)
    extra = len(fill_names) if backend.caps.projection else 0
    runs = len(prompts) * (len(timed) * (c.warmup + c.repeats) + extra)
    with progress_bar(f"timing {backend.title + ' ' if backend.title else ''}prefill to first token", runs) as advance:
        for length, (ids, source) in prompts.items():
            entry = _bench_length(m, timed, ids[0].tolist(), advance)
            entry = {"length": length, "prompt": source, **entry}
            _add_flops(entry, shape, m.plans, fill_names, length)
            for v in fill_names:
                intervals["speedup"][v][str(length)] = entry["fill"][v]["speedup_interval"]
            intervals["exact_vs_transformers"][str(length)] = entry["exact_vs_transformers"]
            results.append(entry)
    for name in fill_names:  # a fill that filled nothing although it had rows to fill timed the exact path
        backend.check_filled(name, (c.warmup + c.repeats) * sum(e["fill"][name]["filled_rows"] for e in results))
    return results, intervals


def _prompts(model, data: str, sizes: list[int], seed: int) -> dict[int, tuple[torch.Tensor, str]]:
    """Per length: token ids [1, N] and where they come from (`model`: the backend's). Real text: one passage from
    within an evaluation document, else consecutive evaluation documents; random ids (seeded) if the corpus is too
    short or `data` is 'random'."""
    tok = model.tokenizer
    corpus = None if data == "random" else load_corpus(data)
    if corpus is not None and not corpus.documents:
        raise RidgefillError(f"--data {data} holds no text: give prompt text, or --data random for random ids")
    docs = [] if corpus is None else documents_for(corpus, "evaluation")
    vocab = model.shape.vocab
    out = {}
    for length in sizes:
        found = passages(tok, docs, length, 1) if docs else []
        source = "passage"
        if not found and docs:
            found, source = token_sequences(tok, docs, length, length), "documents"
        if found:
            out[length] = (torch.tensor([found[0]]), source)
        else:
            g = torch.Generator().manual_seed(seed + length)
            out[length] = (torch.randint(min(3, vocab - 1), vocab, (1, length), generator=g), "random")
    return out


def _bench_length(m: Measurement, timed: list[str], prompt: list[int], advance) -> dict:
    """Time every entry of `timed` (transformers where the backend times it, exact, fill variants) on one prompt,
    interleaved (backends/base.time_first_tokens, the one timing loop)."""
    backend, c, plans = m.backend, m.config, m.plans
    runs, tokens = time_first_tokens(backend, timed, prompt, c.repeats, c.warmup, advance)
    samples = {name: [r.seconds for r in done] for name, done in runs.items()}
    n = len(prompt)
    fill = {}
    for name in list(plans)[1:]:
        iv = ratio_of_medians(samples["exact"], samples[name], seed=c.seed)
        fill[name] = {"speedup": iv.estimate, "speedup_interval": iv.to_dict(),
                      "filled_rows": int((~plans[name].full_rows(n)).sum()), **backend.projection_time(name, prompt)}
        if backend.caps.projection:
            advance()
    head = list(plans)[-1]  # the headline fill variant: the last one listed (ridge when measured)
    reference = (ratio_of_medians(samples["exact"], samples[TRANSFORMERS], seed=c.seed).to_dict()
                 if TRANSFORMERS in samples else None)
    # every engine's entry has the same keys: transformers' forward is null where the engine does not time it
    timings = {TRANSFORMERS: None, **{name: _summary(runs[name], n) for name in timed}}
    return {"headline_variant": head, "speedup": fill[head]["speedup"], "timings": timings,
            "fill": fill, "exact_vs_transformers": reference, "first_token": {TRANSFORMERS: None, **tokens}}


def _summary(runs: list, n: int) -> dict:
    samples = [r.seconds for r in runs]
    median = float(np.median(samples))
    known = [r.peak for r in runs if r.peak["peak_bytes"] is not None]
    out = {"median_s": median, "p90_s": float(np.percentile(samples, 90)), "min_s": float(min(samples)),
           "tokens_per_s": n / median, "samples_s": list(samples)}
    found = [r.latency_s for r in runs if r.latency_s is not None]  # the engine's own (caps.first_token_latency)
    out["engine_first_token_latency_median_s"] = float(np.median(found)) if found else None
    return {**out, "peak_memory_bytes": max((p["peak_bytes"] for p in known), default=None),
            "peak_increase_bytes": max((p["increase_bytes"] for p in known), default=None)}


def _add_flops(entry: dict, shape: ModelShape | None, plans: dict, fill_names: list[str], length: int) -> None:
    """FLOPs of exact and of each fill variant, the limit speedup and the share of it achieved."""
    entry["flops"] = {"exact": prefill_flops(shape, length) if shape else None}
    for name in fill_names:
        plan, row = plans[name], entry["fill"][name]
        if shape is None:
            row.update(flops=None, limit_speedup=None, achieved_over_limit=None)
            continue
        flops = prefill_flops(shape, length, plan.full_rows(length).numpy(), plan.split,
                              plan.filler.flops_per_row(), plan.filler.drops, plan.window)
        limit = entry["flops"]["exact"] / flops
        entry["flops"][name] = flops
        row.update(limit_speedup=limit, achieved_over_limit=row["speedup"] / limit)
    head = entry["fill"][entry["headline_variant"]]
    entry["limit_speedup"], entry["achieved_over_limit"] = head["limit_speedup"], head["achieved_over_limit"]


def _map_memory(m: Measurement) -> dict:
    """Bytes of the maps and of the fused projection's stacked K/V weights; the maps' held-out error."""
    ridge = m.plans.get("ridge")
    meta = m.maps_meta or {}
    layers = meta.get("layers", [])
    return {"map_bytes": ridge.filler.nbytes if ridge is not None else 0,
            "fused_kv_bytes": m.backend.fused_kv_bytes(m.split), "kind": meta.get("kind"),
            "rank": meta.get("rank"),
            "heldout_error": {k: mean([layer.get(f"error_{k}") for layer in layers])
                              for k in ("map", "full_rank", "identity")} if layers else None}


def _load_1m() -> float | None:
    """The 1-minute load average (other processes on a shared machine swing the timings)."""
    load = load_average()
    return load[0] if load else None


def _device_info(backend: Backend, load_before: float | None) -> dict:
    info = backend.device_info()
    info.update(threads=torch.get_num_threads(), cpu=cpu_name(), cpu_count=os.cpu_count(),
                load_average_1m={"start": load_before, "end": _load_1m()})
    if info["device"].startswith("cuda"):
        gpu = device_info("cuda")
        info.update(gpu=gpu["name"], cuda=gpu["cuda"])
    return info


def _print(doc: dict, out, title: str = "") -> None:
    c, timing_rows, speed_rows = doc["config"], [], []
    for entry in doc["results"]:
        for name, t in entry["timings"].items():
            if t is None:  # not timed by this engine (transformers' forward)
                continue
            timing_rows.append([entry["length"], name, *(f"{1000 * t[k]:.1f}" for k in ("median_s", "p90_s", "min_s")),
                                round(t["tokens_per_s"]),
                                "-" if t["peak_memory_bytes"] is None else round(t["peak_memory_bytes"] / 2**20)])
        hf = entry["exact_vs_transformers"]
        for name, f in entry["fill"].items():
            share = "-" if f["projection_share"] is None else f"{100 * f['projection_share']:.1f}%"
            speed_rows.append([entry["length"], name, _interval(f["speedup_interval"]), f["limit_speedup"] or "-",
                               f["achieved_over_limit"] or "-", share, "-" if hf is None else _interval(hf)])
    where = title or f"{doc['device']['device']} ({doc['device']['threads']} threads)"
    ran = doc["device"].get("dtype") or c["dtype"]  # what the engine ran (llama.cpp: the GGUF's own weights)
    title = f"{doc['model']['id']} {ran} on {where}, split {doc['split']}, tail {c['tail']}, {c['repeats']} repeats"
    table(f"time to first token: {title}", ["length", "run", "median ms", "p90 ms", "min ms", "tok/s", "peak MiB"],
          timing_rows)
    table(f"speedup (median exact / median filled) → {out}", ["length", "fill", "speedup [95% CI]", "FLOP limit",
          "achieved/limit", "maps+proj", "exact/transformers"], speed_rows)
    m = doc["map_memory"]
    error = m["heldout_error"] or {}
    text = f"maps {m['map_bytes'] / 2**20:.1f} MiB, fused K/V weights {m['fused_kv_bytes'] / 2**20:.1f} MiB"
    if error.get("map") is not None:
        text += f"; maps (rank {m['rank'] or 'full'}) held-out error {error['map']:.4g}"
        if error.get("identity") is not None:
            text += f", identity fill {error['identity']:.4g}"
    note(text)


def _interval(iv: dict) -> str:
    return format_interval(iv, spec=".2f")
