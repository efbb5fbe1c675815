"""`ridgefill bench-ttft`: time to first token of exact against filled prefill, and the FLOP count that bounds
the speedup.

A timed run is the whole path from prompt token ids to the first generated token: the engine's prefill
(maps applied, caches written) and the greedy choice of the first token. Per length, every variant runs
`warmup` untimed times, then `repeats` timed runs interleaved run by run (the order rotates each round);
transformers' own forward (model(ids, use_cache=True), logits of the last row only) runs on the same prompt
in the same rounds. On CUDA each run is synchronised before the clock stops.

FLOP count (multiply-adds × 2, from the model's shapes; norms, RoPE, softmax and other elementwise work not
counted). Per row and layer: Q, K, V, O projections and the MLP; attention 4·Hq·D·(p+1) for a row at
position p (QKᵀ and AV over its p+1 causal keys); the LM head of the last row. A filled row skips attention,
MLP and the Q and O projections in layers S..L-1 but keeps their K and V projections, and adds its maps
(2·H² per late layer S+1..L-1 for full-rank maps, 4·H·r for rank r, none for identity fill). The limit
speedup is exact FLOPs over filled FLOPs; `achieved_over_limit` is the measured speedup over that limit.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ridgefill import __version__
from ridgefill.runtime.console import note, progress_bar, table
from ridgefill.runtime.data import documents_for, load_corpus, passages, token_sequences
from ridgefill.engine import FillPlan, MapFiller
from ridgefill.engine.projection import BACKENDS, FillProjection
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import ResultWriter, maps_info
from ridgefill.runtime.session import Session, open_session, parse_variants, variant_plans
from ridgefill.evals.stats import format_interval, ratio_of_medians

TRANSFORMERS = "transformers"  # the timing entry of transformers' own forward


# --- FLOP count ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, session: Session) -> "ModelShape":
        a = session.engine.adapter
        return cls(a.n_layers, a.hidden_size, a.n_heads, a.n_kv_heads, a.head_dim, a.config.intermediate_size,
                   a.config.vocab_size)

    def row_flops(self) -> dict[str, int]:
        """FLOPs of one row through one layer's projections and MLP (gate, up, down)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": 2 * h * q, "k": 2 * h * kv, "v": 2 * h * kv, "o": 2 * q * h, "mlp": 3 * 2 * h * self.intermediate}

    def attention_flops(self, positions: np.ndarray) -> int:
        """QKᵀ and AV of rows at `positions` over their causal keys, in one layer."""
        return 4 * self.heads * self.head_dim * int((positions.astype(np.int64) + 1).sum())

    def map_flops(self, split: int, rank: int | None, identity: bool) -> int:
        """FLOPs of one filled row's maps (layers S+1..L-1)."""
        if identity:
            return 0
        per_map = 2 * self.hidden * self.hidden if rank is None else 4 * self.hidden * rank
        return (self.layers - split - 1) * per_map


def prefill_flops(shape: ModelShape, length: int, full: np.ndarray | None = None, split: int | None = None,
                  map_flops: int = 0) -> int:
    """FLOPs of a prefill of `length` rows and its first token. full: [length] bool, the rows that run every
    layer of a filled prefill at `split` (None: exact); map_flops: one filled row's maps."""
    row = shape.row_flops()
    every = np.arange(length)
    exact_layer = length * sum(row.values()) + shape.attention_flops(every)
    lm_head = 2 * shape.hidden * shape.vocab
    if full is None or split is None or split >= shape.layers or full.all():
        return shape.layers * exact_layer + lm_head
    full_pos, n_fill = every[full], int((~full).sum())
    late = len(full_pos) * sum(row.values()) + shape.attention_flops(full_pos) + n_fill * (row["k"] + row["v"])
    return split * exact_layer + (shape.layers - split) * late + n_fill * map_flops + lm_head


# --- the command -----------------------------------------------------------------------------------------
def bench_ttft_command(model="smollm2-135m", maps=None, split=None, tail=256, lengths="1024,2048,4096,8192",
                       repeats=5, warmup=1, device="cpu", dtype="fp32", out=Path("ttft.json"), variants=None,
                       data="wiki-leads", keep_first=1, chunk=2048, threads=0, projection="auto",
                       seed=0) -> dict:
    names = _parse_variants(variants, maps)
    sizes = _parse_lengths(lengths)
    if repeats < 1 or warmup < 0:
        raise RidgefillError(f"--repeats must be >= 1 and --warmup >= 0 (got {repeats}, {warmup})")
    if tail < 1 or keep_first < 0:
        raise RidgefillError("--tail must be at least 1 and --keep-first at least 0")
    if projection not in BACKENDS:
        raise RidgefillError(f"unknown --projection '{projection}': use one of {', '.join(BACKENDS)}")
    if threads < 0:
        raise RidgefillError(f"--threads must be >= 0 (0 keeps torch's default), got {threads}")
    if projection == "triton":
        _check_triton(device)
    if threads:
        torch.set_num_threads(threads)
    config = {"model": model, "maps": str(maps) if maps else None, "split": split, "tail": tail,
              "lengths": sizes, "repeats": repeats, "warmup": warmup, "device": device, "dtype": dtype,
              "variants": names, "data": data, "keep_first": keep_first, "chunk": chunk,
              "threads": torch.get_num_threads(), "projection": projection, "out": str(out)}
    writer = ResultWriter("bench-ttft", config, seed)
    load_before = _load_average()
    session = open_session(model, dtype, device, chunk)
    limit = session.engine.adapter.max_positions
    if limit and sizes[-1] > limit:
        raise RidgefillError(f"--lengths {sizes[-1]} exceeds the model's context of {limit}: use lengths up to "
                             f"{limit}")
    session.engine.projection = FillProjection(session.engine.adapter, projection)
    plans, meta = variant_plans(session, maps, split, tail, range(keep_first), names)
    fill_names = [n for n in names if n != "exact"]
    split = plans[fill_names[0]].split
    if projection == "triton":
        _check_triton_applies(session, split)
    prompts = _prompts(session, data, sizes, seed)
    shape = ModelShape.of(session)
    dense = all(session.engine.adapter.layer_kind(i) == "attention" for i in range(shape.layers))
    if not dense:
        note("note: a hybrid model: the FLOP count covers attention layers only, so no FLOP limit is reported")

    results, intervals = [], {"speedup": {v: {} for v in fill_names}, "exact_vs_transformers": {}}
    timed = [TRANSFORMERS, *names]
    runs = len(sizes) * len(timed) * (warmup + repeats) + len(sizes) * len(fill_names)
    with progress_bar("timing prefill to first token", runs) as advance:
        for length in sizes:
            ids, source = prompts[length]
            entry = _bench_length(session, plans, timed, ids, repeats, warmup, seed, advance)
            entry = {"length": length, "prompt": source, **entry}
            _add_flops(entry, shape if dense else None, plans, fill_names, length)
            for v in fill_names:
                intervals["speedup"][v][str(length)] = entry["fill"][v]["speedup_interval"]
            intervals["exact_vs_transformers"][str(length)] = entry["exact_vs_transformers"]
            results.append(entry)
    memory = _map_memory(session, plans, meta, split)
    for entry in results:
        entry["map_bytes"] = memory["map_bytes"]
    doc = writer.write(out, session.loaded.info(), maps_info(maps, meta), names, results, intervals,
                       split=split, map_memory=memory, device=_device_info(session, load_before),
                       versions=_versions())
    _print(doc, out)
    return doc


def _parse_variants(variants, maps) -> list[str]:
    names = parse_variants(variants, maps)  # exact first
    if len(names) < 2:
        raise RidgefillError("--variants needs at least one of identity, ridge besides exact (the speedup is "
                             "exact time over filled time)")
    return names


def _parse_lengths(lengths) -> list[int]:
    try:
        sizes = sorted({int(s) for s in str(lengths).split(",") if s.strip()})
    except ValueError:
        raise RidgefillError(f"--lengths '{lengths}' is not a comma-separated list of integers") from None
    if not sizes or sizes[0] < 2:
        raise RidgefillError(f"--lengths '{lengths}': give prompt lengths of at least 2 tokens")
    return sizes


def _check_triton(device: str) -> None:
    # find_spec, not an import of triton_projection: importing it fixes whether its kernel is interpreted
    if importlib.util.find_spec("triton") is None:
        raise RidgefillError("--projection triton needs triton: pip install triton (or use --projection auto)")
    if device != "cuda" and not _interpreting():
        raise RidgefillError("--projection triton runs on CUDA (or under TRITON_INTERPRET=1): use --projection auto")


def _check_triton_applies(session: Session, split: int) -> None:
    from ridgefill.engine.triton_projection import supports

    stack = session.engine.projection.stack(split)
    if stack is None or not supports(stack, stack.head_dim):
        raise RidgefillError("--projection triton does not apply to this model (it needs dense attention layers "
                             "with head_dim a power of two >= 32): use --projection auto")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _prompts(session: Session, data: str, sizes: list[int], seed: int) -> dict[int, tuple[torch.Tensor, str]]:
    """Per length: token ids [1, N] and where they come from. Real text: one passage from within an evaluation
    document, else consecutive evaluation documents; random ids (seeded) if the corpus is too short or
    `data` is 'random'."""
    tok = session.tokenizer
    docs = [] if data == "random" else documents_for(load_corpus(data), "evaluation")
    vocab = session.engine.adapter.config.vocab_size
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
    runs = {name: _runner(session, name, plans, ids) for name in timed}
    device = session.engine.adapter.device
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
                      **_projection_time(session, runs[name], device)}
        advance()
    head = timed[-1]  # the headline fill variant: the last one listed (ridge when measured)
    return {"headline_variant": head, "speedup": fill[head]["speedup"],
            "timings": {name: _summary(samples[name], peaks[name], n) for name in timed}, "fill": fill,
            "exact_vs_transformers": ratio_of_medians(samples["exact"], samples[TRANSFORMERS], seed=seed).to_dict(),
            "first_token": tokens}


def _runner(session: Session, name: str, plans: dict, ids: torch.Tensor):
    """A function that runs prompt ids to the first (greedy) token with `name`'s prefill, returning the token."""
    engine, model = session.engine, session.loaded.model
    device_ids = ids.to(engine.adapter.device)
    n = ids.shape[1]

    def transformers_forward() -> int:
        with torch.inference_mode():
            logits = model(device_ids, use_cache=True, logits_to_keep=1).logits  # [1, 1, V]
        return int(logits[0, -1].argmax())

    def engine_prefill() -> int:
        pre = engine.prefill(device_ids, fill=plans[name], capacity=n + 1)
        return int(pre.logits[0, -1].argmax())

    return transformers_forward if name == TRANSFORMERS else engine_prefill


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


def _projection_time(session: Session, run, device: torch.device) -> dict:
    """One more (untimed-for-the-speedup) filled run with the fill projection's own timer on: the wall time of
    the maps and the fused K/V projection, and their share of that run."""
    projection = session.engine.projection
    projection.timed, projection.elapsed_s = True, 0.0
    try:
        seconds, _, _ = _timed(run, device)
    finally:
        projection.timed = False
    return {"projection_s": projection.elapsed_s, "projection_share": projection.elapsed_s / seconds,
            "instrumented_run_s": seconds}


def _add_flops(entry: dict, shape: ModelShape | None, plans: dict, fill_names: list[str], length: int) -> None:
    """FLOPs of exact and of each fill variant, the limit speedup and the share of it achieved."""
    entry["flops"] = {"exact": prefill_flops(shape, length) if shape else None}
    for name in fill_names:
        plan, row = plans[name], entry["fill"][name]
        if shape is None:
            row.update(flops=None, limit_speedup=None, achieved_over_limit=None)
            continue
        filler = plan.filler
        mapped = isinstance(filler, MapFiller)
        rank = filler.v.shape[1] if mapped and filler.low_rank is not None else None
        flops = prefill_flops(shape, length, plan.full_rows(length).numpy(), plan.split,
                              shape.map_flops(plan.split, rank, identity=not mapped))
        limit = entry["flops"]["exact"] / flops
        entry["flops"][name] = flops
        row.update(limit_speedup=limit, achieved_over_limit=row["speedup"] / limit)
    head = entry["fill"][entry["headline_variant"]]
    entry["limit_speedup"], entry["achieved_over_limit"] = head["limit_speedup"], head["achieved_over_limit"]


def _map_memory(session: Session, plans: dict, meta: dict | None, split: int) -> dict:
    """Bytes of the maps and of the fused projection's stacked K/V weights; the maps' held-out error."""
    filler = plans["ridge"].filler if "ridge" in plans else None
    names = ("stacked", "stacked_u", "v", "biases")
    map_bytes = 0
    if isinstance(filler, MapFiller):
        map_bytes = sum(getattr(filler, k).numel() * getattr(filler, k).element_size() for k in names
                        if hasattr(filler, k))
    stack = session.engine.projection.stack(split)
    layers = (meta or {}).get("layers", [])
    return {"map_bytes": map_bytes, "fused_kv_bytes": stack.nbytes if stack is not None else 0,
            "kind": (meta or {}).get("kind"), "rank": (meta or {}).get("rank"),
            "heldout_error": {k: _mean([layer.get(f"error_{k}") for layer in layers])
                              for k in ("map", "full_rank", "identity")} if layers else None}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not np.isnan(v)]
    return float(np.mean(values)) if values else None


def _load_average() -> float | None:
    """The 1-minute load average (other processes on a shared machine swing the timings)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _device_info(session: Session, load_before: float | None) -> dict:
    device = session.engine.adapter.device
    info = {"device": str(device), "dtype": str(session.engine.adapter.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "load_average_1m": {"start": load_before, "end": _load_average()}}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"ridgefill": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "numpy", "triton"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _print(doc: dict, out) -> None:
    c, timing_rows, speed_rows = doc["config"], [], []
    for entry in doc["results"]:
        for name, t in entry["timings"].items():
            timing_rows.append([entry["length"], name, *(f"{1000 * t[k]:.1f}" for k in ("median_s", "p90_s", "min_s")),
                                round(t["tokens_per_s"]), round((t["peak_memory_bytes"] or 0) / 2**20)])
        hf = entry["exact_vs_transformers"]
        for name, f in entry["fill"].items():
            speed_rows.append([entry["length"], name, _interval(f["speedup_interval"]), f["limit_speedup"] or "-",
                               f["achieved_over_limit"] or "-", f"{100 * f['projection_share']:.1f}%",
                               _interval(hf)])
    title = (f"{doc['model']['id']} {c['dtype']} on {doc['device']['device']} ({doc['device']['threads']} threads), "
             f"split {doc['split']}, tail {c['tail']}, {c['repeats']} repeats")
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
