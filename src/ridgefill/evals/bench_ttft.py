"""`ridgefill bench-ttft`: time to first token of exact against filled prefill, and the FLOP count that bounds
the speedup.

A timed run is the whole path from prompt token ids to the first generated token: the engine's prefill
(maps applied, caches written) and the greedy choice of the first token. Per length, every variant runs
`warmup` untimed times, then `repeats` timed runs interleaved run by run (the order rotates each round);
transformers' own forward (model(ids, use_cache=True), logits of the last row only) runs on the same prompt
in the same rounds. On CUDA each run is synchronised before the clock stops. One more run of each fill variant,
on an engine whose fill projection is timed (a Stopwatch), gives the projection's share of a filled prefill.

The FLOP count (evals/flops.py) gives each variant's FLOPs; the limit speedup is exact FLOPs over filled FLOPs,
and `achieved_over_limit` is the measured speedup over that limit.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ridgefill.commands import Command, option
from ridgefill.engine import BACKENDS, Engine, FillPlan, ModelShape, Stopwatch
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import MeasureConfig, Measurement, parse_lengths, start
from ridgefill.evals.flops import prefill_flops
from ridgefill.runtime.stats import format_interval, mean, ratio_of_medians
from ridgefill.method.fill import ServedOptions, Tuned, load_serving, parse_variants
from ridgefill.runtime.console import note, progress_bar, table
from ridgefill.runtime.data import documents_for, load_corpus, passages, token_sequences
from ridgefill.runtime.provenance import cpu_name, device_info, load_average, versions
from ridgefill.runtime.session import Session, check_length
from ridgefill.serve.vllm_engine import check_engine, engine_cpu_only, engine_option

TRANSFORMERS = "transformers"  # the timing entry of transformers' own forward


# --- options -------------------------------------------------------------------------------------------
@dataclass
class BenchConfig(MeasureConfig, ServedOptions):
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
    engine: str = engine_option()

    def check(self) -> None:
        super().check()
        self.names()
        self.sizes()
        if self.repeats < 1 or self.warmup < 0:
            raise RidgefillError(f"--repeats must be >= 1 and --warmup >= 0 (got {self.repeats}, {self.warmup})")
        if self.projection not in BACKENDS:
            raise RidgefillError(f"unknown --projection '{self.projection}': use one of {', '.join(BACKENDS)}")
        if self.threads < 0:
            raise RidgefillError(f"--threads must be >= 0 (0 keeps torch's default), got {self.threads}")
        check_engine(self.engine)
        if self.engine == "vllm" and self.projection != "auto":
            raise RidgefillError("--projection chooses ridgefill's own fill projection: drop it with --engine vllm")

    def source_rule(self):
        return ("variants",), None

    def cpu_only(self) -> str | None:
        return engine_cpu_only(self.engine)

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
        serving.check_model(m.session.loaded.fingerprint, c.serving_config)
    _check_model(m, c.sizes()[-1])
    prompts = _prompts(m.session, c.data, c.sizes(), c.seed)
    flops_shape = m.session.shape
    extra = {}
    if c.engine == "vllm":
        from ridgefill.evals import bench_ttft_vllm

        with bench_ttft_vllm.scratch_folder() as scratch:
            results, intervals, extra["vllm_engines"] = bench_ttft_vllm.bench_lengths(
                m, prompts, lambda entry, plans, names, n: _add_flops(entry, flops_shape, plans, names, n),
                Path(scratch))
    else:
        results, intervals = _bench_lengths(m, prompts, flops_shape)
    memory = _map_memory(m)
    for entry in results:
        entry["map_bytes"] = memory["map_bytes"]
    doc = m.write(results, intervals, split=m.split, map_memory=memory,
                  device=_device_info(m.session.engine, load_before), versions=versions(), **extra)
    _print(doc, c.out)
    return doc


def _check_model(m: Measurement, longest: int) -> None:
    """What needs the model: the longest prompt fits its context."""
    limit = m.session.context_length
    check_length("--lengths", longest, limit, f"use lengths up to {limit}")


COMMAND = Command("bench-ttft", BenchConfig, run, writes=".json", reads="maps")


def _bench_lengths(m: Measurement, prompts: dict, shape: ModelShape | None) -> tuple[list[dict], dict]:
    """Every length's timings, speedups and FLOPs (shape None: no FLOP count), and the speedups' intervals."""
    c = m.config
    fill_names = list(m.plans)[1:]  # after exact
    results, intervals = [], {"speedup": {v: {} for v in fill_names}, "exact_vs_transformers": {}}
    timed = [TRANSFORMERS, *m.plans]
    runs = len(prompts) * len(timed) * (c.warmup + c.repeats) + len(prompts) * len(fill_names)
    with progress_bar("timing prefill to first token", runs) as advance:
        for length, (ids, source) in prompts.items():
            entry = _bench_length(m.session, m.plans, timed, ids, c.repeats, c.warmup, c.seed, advance)
            entry = {"length": length, "prompt": source, **entry}
            _add_flops(entry, shape, m.plans, fill_names, length)
            for v in fill_names:
                intervals["speedup"][v][str(length)] = entry["fill"][v]["speedup_interval"]
            intervals["exact_vs_transformers"][str(length)] = entry["exact_vs_transformers"]
            results.append(entry)
    return results, intervals


def _prompts(session: Session, data: str, sizes: list[int], seed: int) -> dict[int, tuple[torch.Tensor, str]]:
    """Per length: token ids [1, N] and where they come from. Real text: one passage from within an evaluation
    document, else consecutive evaluation documents; random ids (seeded) if the corpus is too short or
    `data` is 'random'."""
    tok = session.tokenizer
    corpus = None if data == "random" else load_corpus(data)
    if corpus is not None and not corpus.documents:
        raise RidgefillError(f"--data {data} holds no text: give prompt text, or --data random for random ids")
    docs = [] if corpus is None else documents_for(corpus, "evaluation")
    vocab = session.shape.vocab
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


def _bench_length(session: Session, plans: dict, timed: list[str], ids: torch.Tensor, repeats: int,
                  warmup: int, seed: int, advance) -> dict:
    """Time every entry of `timed` (transformers, exact, fill variants) on one prompt, interleaved."""
    runs = {name: _runner(session.engine, plans[name], ids) if name != TRANSFORMERS else _forward(session, ids)
            for name in timed}
    device = session.engine.device
    samples, peaks, tokens = {name: [] for name in timed}, {name: [] for name in timed}, {}
    gc.collect()
    for _ in range(warmup):
        for name in timed:
            runs[name]()
            advance()
    for r in range(repeats):
        for name in timed[r % len(timed):] + timed[: r % len(timed)]:  # rotated: no entry always runs first
            seconds, tokens[name], peak = _timed(runs[name], device)
            samples[name].append(seconds)
            peaks[name].append(peak)
            advance()
    n = ids.shape[1]
    fill = {}
    for name in timed[2:]:
        iv = ratio_of_medians(samples["exact"], samples[name], seed=seed)
        fill[name] = {"speedup": iv.estimate, "speedup_interval": iv.to_dict(),
                      "filled_rows": int((~plans[name].full_rows(n)).sum()),
                      **_projection_time(session, plans[name], ids)}
        advance()
    head = timed[-1]  # the headline fill variant: the last one listed (ridge when measured)
    return {"headline_variant": head, "speedup": fill[head]["speedup"],
            "timings": {name: _summary(samples[name], peaks[name], n) for name in timed}, "fill": fill,
            "exact_vs_transformers": ratio_of_medians(samples["exact"], samples[TRANSFORMERS], seed=seed).to_dict(),
            "first_token": tokens}


def _forward(session: Session, ids: torch.Tensor):
    """A function that runs transformers' own forward on prompt ids and returns the first (greedy) token."""
    model, device_ids = session.model, ids.to(session.engine.device)

    def transformers_forward() -> int:
        with torch.inference_mode():
            logits = model(device_ids, use_cache=True, logits_to_keep=1).logits  # [1, 1, V]
        return int(logits[0, -1].argmax())

    return transformers_forward


def _runner(engine: Engine, plan: FillPlan | None, ids: torch.Tensor):
    """A function that runs prompt ids to the first (greedy) token with the engine's prefill under `plan`
    (None: exact), returning the token."""
    device_ids = ids.to(engine.device)
    n = ids.shape[1]

    def engine_prefill() -> int:
        pre = engine.prefill(device_ids, fill=plan, capacity=n + 1)
        return int(pre.logits[0, -1].argmax())

    return engine_prefill


def _timed(run, device: torch.device) -> tuple[float, int, dict]:
    """One run: seconds (no garbage-collector pause inside), the first token, peak memory."""
    baseline = _reset_peak(device)
    gc.disable()
    try:
        _sync(device)
        t0 = time.perf_counter()
        token = run()
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    return seconds, token, _peak(device, baseline)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int | None:
    """Reset the peak-memory mark; returns the memory in use now (bytes). CUDA: allocated tensors; CPU: the
    process's resident set (Linux: /proc/self/clear_refs resets its high-water mark)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _peak(device: torch.device, baseline: int | None) -> dict:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _proc_status("VmHWM") if baseline is not None else None
    return {"peak_bytes": peak, "increase_bytes": None if peak is None or baseline is None else peak - baseline}


def _proc_status(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _summary(samples: list[float], peaks: list[dict], n: int) -> dict:
    median = float(np.median(samples))
    known = [p for p in peaks if p["peak_bytes"] is not None]
    return {"median_s": median, "p90_s": float(np.percentile(samples, 90)), "min_s": float(min(samples)),
            "tokens_per_s": n / median, "samples_s": list(samples),
            "peak_memory_bytes": max((p["peak_bytes"] for p in known), default=None),
            "peak_increase_bytes": max((p["increase_bytes"] for p in known), default=None)}


def _projection_time(session: Session, plan: FillPlan, ids: torch.Tensor) -> dict:
    """One more (untimed-for-the-speedup) filled run on an engine whose fill projection is timed: the wall time
    of the maps and the fused K/V projection, and their share of that run."""
    timer = Stopwatch(session.engine.device)
    seconds, _, _ = _timed(_runner(session.timed_engine(timer), plan, ids), session.engine.device)
    return {"projection_s": timer.elapsed_s, "projection_share": timer.elapsed_s / seconds,
            "instrumented_run_s": seconds}


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
            "fused_kv_bytes": m.session.engine.fused_kv_bytes(m.split), "kind": meta.get("kind"),
            "rank": meta.get("rank"),
            "heldout_error": {k: mean([layer.get(f"error_{k}") for layer in layers])
                              for k in ("map", "full_rank", "identity")} if layers else None}


def _load_1m() -> float | None:
    """The 1-minute load average (other processes on a shared machine swing the timings)."""
    load = load_average()
    return load[0] if load else None


def _device_info(engine: Engine, load_before: float | None) -> dict:
    device = engine.device
    info = {"device": str(device), "dtype": str(engine.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "load_average_1m": {"start": load_before, "end": _load_1m()},
            "routes": engine.routes.describe()}  # the attention, window, projection and delta-rule routes taken
    if device.type == "cuda":
        gpu = device_info("cuda")
        info.update(gpu=gpu["name"], cuda=gpu["cuda"])
    return info


def _print(doc: dict, out) -> None:
    c, timing_rows, speed_rows = doc["config"], [], []
    for entry in doc["results"]:
        for name, t in entry["timings"].items():
            timing_rows.append([entry["length"], name, *(f"{1000 * t[k]:.1f}" for k in ("median_s", "p90_s", "min_s")),
                                round(t["tokens_per_s"]), round((t["peak_memory_bytes"] or 0) / 2**20)])
        hf = entry["exact_vs_transformers"]
        for name, f in entry["fill"].items():
            share = "-" if f["projection_share"] is None else f"{100 * f['projection_share']:.1f}%"
            speed_rows.append([entry["length"], name, _interval(f["speedup_interval"]), f["limit_speedup"] or "-",
                               f["achieved_over_limit"] or "-", share, "-" if hf is None else _interval(hf)])
    where = "vLLM" if c.get("engine") == "vllm" else f"{doc['device']['device']} ({doc['device']['threads']} threads)"
    title = (f"{doc['model']['id']} {c['dtype']} on {where}, split {doc['split']}, tail {c['tail']}, "
             f"{c['repeats']} repeats")
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
