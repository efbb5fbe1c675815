"""Decode speed in vLLM with RidgeFill's plugin configured against stock vLLM, one worker of each alive and their runs
interleaved (A B B A ...), so that a busy or drifting machine moves both alike (issue #25's decode bar).

Usage: python scripts/bench_decode_vllm.py MAPS [--rounds 8] [--batch 8] [--prompt 100] [--tokens 256] [--out F]
Both workers: the embedded SmolLM2 (fp32), compiled, prefix caching on, threads 0-1, as `ridgefill serve` runs them.
The plugin's worker is configured with MAPS and tail 256; prompts of --prompt tokens (random ids) are shorter than
the tail, so nothing is filled and every step after the first is a decode step: what is measured is what loading
the plugin costs decode. Each run generates --tokens tokens for --batch prompts at once (new salts: no cache hits).
Prints per-round times and the plugin/stock tokens-per-second ratio of medians with its paired bootstrap interval;
--out writes them as JSON."""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

from ridgefill.method.fill import FillSettings
from ridgefill.runtime.models import model_folder
from ridgefill.runtime.paths import file_sha256
from ridgefill.runtime.stats import ratio_of_medians
from ridgefill.backends.vllm.worker import WorkerSettings, VllmWorker


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("maps", type=Path)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    folder = model_folder("smollm2-135m")
    rng = random.Random(0)
    batch = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(a.batch)]
    fill = FillSettings("ridge", maps=a.maps, tail=256, maps_sha256=file_sha256(a.maps))  # pinned, as serve does
    common = dict(max_model_len=2048, kv_cache_gib=2, compiled=True, threads="0-1")
    workers = {"stock": VllmWorker(WorkerSettings(folder, None, plugin=False, **common)),
               "plugin": VllmWorker(WorkerSettings(folder, fill, **common))}
    try:
        for name, worker in workers.items():  # warm-up: the first steps of a compiled worker
            worker.generate(batch, 16, cache_salt=f"warm-{name}")
        times = {name: [] for name in workers}
        for r in range(a.rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for name in order:
                time.sleep(1.0)  # the other worker's threads go idle
                start = time.perf_counter()
                workers[name].generate(batch, a.tokens, cache_salt=f"{name}-{r}")
                times[name].append(time.perf_counter() - start)
            print(f"round {r}: " + "  ".join(f"{n} {times[n][-1]:.3f} s" for n in workers), flush=True)
        tally = workers["plugin"].tally()
    finally:
        for worker in workers.values():
            worker.close()
    ratio = ratio_of_medians(times["stock"], times["plugin"])  # plugin tokens/s over stock's
    tokens = a.batch * a.tokens
    doc = {"rounds": a.rounds, "batch": a.batch, "prompt_tokens": a.prompt, "generated_tokens": a.tokens,
           "times_s": times, "tokens_per_s": {n: tokens / statistics.median(t) for n, t in times.items()},
           "plugin_over_stock": ratio.to_dict(), "plugin_tally": tally}
    print(f"decode tokens/s, plugin / stock (median of {a.rounds}): {ratio.estimate:.3f} "
          f"[{ratio.low:.3f}, {ratio.high:.3f}]; filled rows {tally.get('filled_tokens')}")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
