"""Time to first token of llama.cpp's own llama-server with RidgeFill (--ridgefill) against the same binary without
it, one prompt at a time, and the FLOP limit of that speedup (evals/flops.py, as bench-ttft computes it).

    python scripts/llama_server_ttft.py --model smollm2-135m --maps maps-s18.safetensors --length 4096 \
        --tail 256 --repeats 3 --threads 2 --out ttft-llama-server.json

Both servers (the installed patched llama-server, or RIDGEFILL_LLAMA_SERVER's) load the GGUF side by side, one slot
each, an F16 K/V cache, flash attention, 2,048-row batches and 512-row ubatches, the RAM prompt cache off; a round sends
one prompt of `--length` random token ids (fresh each round, `cache_prompt` off: nothing is reused) to each server in
turn, the first server of a round alternating; the first `--warmup` rounds are not kept. TTFT is the client's wall
time of a one-token completion; llama-server's own `timings.prompt_ms` is kept beside it. The speedup is the median
stock TTFT over the median filled one; the interval is the 2.5–97.5 % range of the ratio of medians over 2,000
bootstrap resamples of the rounds. Maps: .safetensors are written as an F32 adapter beside --out, a .gguf is used as
it is. Writes JSON (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def start(binary: str, gguf: str, port: int, threads: int, ctx: int, fill: list[str]) -> subprocess.Popen:
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "-np", "1", "-b", "2048",
            "-ub", "512", "-t", str(threads), "-tb", str(threads), "-fa", "on", "-ctk", "f16", "-ctv", "f16",
            "--cache-ram", "0", "--metrics", *fill]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}): {' '.join(argv)}")
    raise SystemExit("llama-server did not answer")


def first_token(port: int, ids: list[int]) -> tuple[float, float]:
    """(wall seconds of a one-token completion of `ids`, llama-server's prompt_ms / 1000)."""
    body = json.dumps({"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": False}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as r:
        answer = json.load(r)
    return time.perf_counter() - began, answer["timings"]["prompt_ms"] / 1000


def ratio_interval(stock: list[float], filled: list[float], seed: int = 0) -> tuple[float, float]:
    rng, ratios = random.Random(seed), []
    for _ in range(2000):
        rounds = [rng.randrange(len(stock)) for _ in stock]
        ratios.append(statistics.median(stock[i] for i in rounds) / statistics.median(filled[i] for i in rounds))
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def flop_limit(model: str, maps: str, length: int, tail: int, keep_first: int) -> float:
    from ridgefill.evals.flops import prefill_flops
    from ridgefill.method.fill import FillSettings
    from ridgefill.runtime.session import model_facts

    facts = model_facts(model)
    plan, _ = FillSettings("ridge", None, Path(maps), tail=tail, keep_first=keep_first).plan(facts)
    full = plan.full_rows(length).numpy()
    exact = prefill_flops(facts.shape, length)
    return exact / prefill_flops(facts.shape, length, full, plan.split, plan.filler.flops_per_row())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--maps", required=True)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--tail", type=int, default=256)
    parser.add_argument("--keep-first", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from ridgefill.backends.llamacpp.server import llama_server
    from ridgefill.method.maps import load_maps, write_maps
    from ridgefill.method.maps_gguf import is_gguf
    from ridgefill.runtime.models import gguf_file
    from ridgefill.runtime.paths import atomic_path

    gguf, binary = str(gguf_file(args.model)), str(llama_server())
    adapter = args.maps
    if not is_gguf(args.maps):
        adapter = str(args.out.with_suffix(".maps.gguf"))
        tensors, meta, _ = load_maps(args.maps)
        write_maps(Path(adapter), tensors, meta, "f32", model=args.model)
    fill = ["--ridgefill", adapter, "--ridgefill-tail", str(args.tail), "--ridgefill-keep-first",
            str(args.keep_first), "--ridgefill-outlier-factor", "20"]
    ports = {"stock": 18301, "ridge": 18302}
    procs = {"stock": start(binary, gguf, ports["stock"], args.threads, args.length + 64, []),
             "ridge": start(binary, gguf, ports["ridge"], args.threads, args.length + 64, fill)}
    rng = random.Random(args.seed)
    times: dict[str, list] = {"stock": [], "ridge": []}
    try:
        for r in range(args.warmup + args.repeats):
            order = ["stock", "ridge"] if r % 2 == 0 else ["ridge", "stock"]
            ids = [rng.randrange(100, 49152) for _ in range(args.length)]
            for name in order:
                wall, prompt = first_token(ports[name], ids)
                print(f"round {r} {name}: {wall:.2f} s (prompt {prompt:.2f} s)", file=sys.stderr, flush=True)
                if r >= args.warmup:
                    times[name].append({"wall_s": wall, "prompt_s": prompt})
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['ridge']}/metrics") as m:
            counters = {line.split()[0]: float(line.split()[1]) for line in m.read().decode().splitlines()
                        if line.startswith("ridgefill_")}
    finally:
        for p in procs.values():
            p.terminate()
            p.wait()
    stock = [t["wall_s"] for t in times["stock"]]
    ridge = [t["wall_s"] for t in times["ridge"]]
    speedup = statistics.median(stock) / statistics.median(ridge)
    low, high = ratio_interval(stock, ridge)
    limit = flop_limit(args.model, args.maps, args.length, args.tail, args.keep_first)
    result = {"model": args.model, "gguf": gguf, "binary": binary, "maps": args.maps, "length": args.length,
              "tail": args.tail, "keep_first": args.keep_first, "threads": args.threads, "times": times,
              "median_s": {"stock": statistics.median(stock), "ridge": statistics.median(ridge)},
              "speedup": speedup, "speedup_interval": [low, high], "flop_limit": limit,
              "achieved_over_limit": speedup / limit, "counters": counters}
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1))
    print("| tokens | stock median (min) | ridge median (min) | speedup [95% CI] | FLOP limit | achieved / limit |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.length:,} | {statistics.median(stock):.1f} s ({min(stock):.1f} s) | {statistics.median(ridge):.1f} s "
          f"({min(ridge):.1f} s) | {speedup:.2f} [{low:.2f}, {high:.2f}] | {limit:.2f} | {speedup / limit:.0%} |")
    print(f"llama-server's counters: {counters}")


if __name__ == "__main__":
    main()
