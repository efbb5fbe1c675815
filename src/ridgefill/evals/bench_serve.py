"""`ridgefill bench-serve`: a load test of RidgeFill in an engine's server against the same engine stock, on loopback,
bounded in time.

It starts the engine's server stock (the same command line, context, threads and options as serve's, no fill and no
request guard: Server.launch with no fill) and then as `ridgefill serve --engine E` runs it (the fill), one at a
time, and drives each with the same seeded request stream (the server's `drive`: vLLM's own benchmark client,
vllm.benchmarks.serve.benchmark; for llama.cpp ridgefill's client, backends/load.py): Poisson arrivals at each of
`--rates` (requests/s), `--requests` prompts per rate of about `--prompt-tokens` tokens (each drawn uniformly within
±25 %) cut from evaluation documents of `--data`, `--output-tokens` greedy tokens each (end-of-sequence kept out).
Both servers run as `ridgefill serve` runs them (vLLM: its default compilation and prefix caching on, every request
with a cache salt of its own, so no prompt hits the cache; llama.cpp: one context whose prefix reuse follows the fill
rule, and consecutive prompts share no prefix). A rate's prompts are the same for both variants and across rates.

Per rate and variant: TTFT p50/p90/p99 each with a seeded bootstrap interval, mean TPOT ((latency − TTFT) / (output
tokens − 1)), request throughput, and goodput (requests finished within the TTFT objective `--slo-ttft`, per
second); per rate the fill/stock ratio of TTFT p50 with a seeded paired bootstrap interval (the same prompt under
both variants is a pair). Writes --out (JSON: `results`, one entry per rate and variant; `ratios`, per rate; `engine`,
the engine's name and build as every result names it), a PNG of TTFT percentiles against rate beside it
(<out>.png), and prints a table. The servers' logs are in this user's
private log folder, serve's (named in the JSON).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ridgefill.commands import REQUIRED, Command, option
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import ResultWriter
from ridgefill.runtime.console import note, table
from ridgefill.runtime.paths import check_output
from ridgefill.runtime.stats import percentile, ratio_of_medians
from ridgefill.backends import SERVING_DEFAULT, backend_class, server_args_help, server_of
from ridgefill.serve.serve import ENGINE_HELP, SERVED_DTYPE_HELP, ServedFill

VARIANTS = ("exact", "ridge")  # the engine stock, then with RidgeFill (the fill of the fill options)
SPREAD = 0.25  # prompt lengths are drawn uniformly within ±SPREAD of --prompt-tokens


@dataclass
class BenchServeConfig(ServedFill):
    data: str = option("shakespeare", "Text whose evaluation documents the prompts are cut from.")
    rates: str = option("0.05,0.1,0.2", "Request rates to test (requests/s), comma-separated: from light to past "
                        "the stock server's saturation.", listed=str)
    requests: int = option(12, "Requests per rate and variant.")
    prompt_tokens: int = option(2048, "Mean prompt length (tokens); each prompt is drawn within ±25 % of it.")
    output_tokens: int = option(32, "Tokens each request generates (greedy; end-of-sequence ignored).")
    slo_ttft: float = option(5.0, "TTFT objective (seconds): goodput counts the requests that meet it.")
    time_limit: float = option(1800.0, "Seconds one rate's run of one variant may take before the test stops.")
    dtype: str = option("auto", SERVED_DTYPE_HELP)
    seed: int = option(0, "Seed of the prompts, the arrivals and the bootstrap.")
    out: Path = option(REQUIRED, "Result JSON to write (and <out>.png beside it).")
    engine: str = option(SERVING_DEFAULT, ENGINE_HELP)
    server_args: list[str] = option([], server_args_help() + " Both servers get them.")

    def check(self) -> None:
        super().check()
        server_of(self.engine)  # an engine without a server: one line
        self.rate_values()
        for flag, value in (("--requests", self.requests), ("--output-tokens", self.output_tokens),
                            ("--prompt-tokens", self.prompt_tokens)):
            if value < 1:
                raise RidgefillError(f"{flag} {value} must be at least 1")
        if not (self.slo_ttft > 0 and math.isfinite(self.slo_ttft)) or not self.time_limit > 0:
            raise RidgefillError(f"--slo-ttft {self.slo_ttft:g} and --time-limit {self.time_limit:g} must be positive "
                                 "numbers of seconds")
        check_output(self, beside=(".png",))

    def rate_values(self) -> list[float]:
        try:
            rates = [float(r) for r in str(self.rates).split(",") if r.strip()]
        except ValueError:
            raise RidgefillError(f"--rates '{self.rates}' is not a comma-separated list of numbers, e.g. "
                                 "0.05,0.1,0.2") from None
        if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
            raise RidgefillError(f"--rates '{self.rates}' must list positive request rates (requests/s)")
        return sorted(set(rates))


def run(c: BenchServeConfig) -> dict:
    from ridgefill.backends.serving import free_port, served_name
    from ridgefill.runtime.models import model_folder
    from ridgefill.serve.log import log_folder
    from ridgefill.serve.process import running
    from ridgefill.serve.serve import ServeConfig, serve_plan, stock_plan

    server = server_of(c.engine)
    folder = model_folder(c.model)
    # recorded resolved (vLLM: fp32 or bf16; llama.cpp: the GGUF's own types); serve resolves --dtype alike
    writer = ResultWriter("bench-serve", {**c.as_dict(), "dtype": server.served_dtype(c.dtype, c.model)}, c.seed)
    tokenizer = _tokenizer(folder)
    # one more prompt than a rate sends: the warm-up's, so no timed prompt follows itself (llama.cpp keeps the
    # previous prompt's prefix; vLLM's requests carry cache salts)
    *prompts, warm_up = request_prompts(tokenizer, c.data, c.requests + 1, c.prompt_tokens, c.seed)
    longest = max(map(len, prompts)) + c.output_tokens + 8
    logs = log_folder()  # private to this user, not the shared temporary folder
    served = ServeConfig(model=c.model, maps=c.maps, split=c.split, tail=c.tail, keep_first=c.keep_first,
                         outlier_factor=c.outlier_factor, serving_config=c.serving_config, port=free_port(),
                         dtype=c.dtype, log_file=logs / "bench-serve-ridge.log", engine=c.engine,
                         server_args=[*c.server_args, *server.context_args(longest)],
                         **admitted(server.bench_concurrency(c.requests)))
    served.check()
    results, per_request = [], {}
    with tempfile.TemporaryDirectory(prefix="ridgefill-bench-serve-") as scratch:
        plans = {"ridge": serve_plan(served, Path(scratch)),
                 "exact": stock_plan(served, Path(scratch), logs / "bench-serve-exact.log")}
        for variant in VARIANTS:
            note(f"bench-serve: {variant}: starting the server (log: {plans[variant].log})")
            with running(plans[variant]):
                base, name = plans[variant].health.removesuffix("/health"), served_name(c.model)
                server.drive(base, name, tokenizer, [warm_up], math.inf, c.output_tokens, c.seed, c.time_limit,
                             salt="warm-up")  # one untimed request: the first filled step's one-time costs
                for rate in c.rate_values():
                    note(f"bench-serve: {variant} at {rate:g} requests/s ({c.requests} requests)")
                    outputs = server.drive(base, name, tokenizer, prompts, rate, c.output_tokens, c.seed, c.time_limit)
                    per_request[(variant, rate)] = outputs
                    results.append(summary(variant, rate, outputs, c.slo_ttft, c.seed))
    ratios = [ttft_ratio(rate, per_request[("exact", rate)], per_request[("ridge", rate)], c.seed)
              for rate in c.rate_values()]
    figure = Path(f"{c.out}.png")
    plot(results, figure, c.slo_ttft, server.title)
    build = backend_class(c.engine).provenance()
    doc = writer.write(c.out, {"id": c.model}, None, list(VARIANTS), results, {},
                       ratios=ratios, prompts={"count": len(prompts), "tokens": [len(p) for p in prompts]},
                       servers={v: {"argv": plans[v].argv[3:], "log": str(plans[v].log)} for v in VARIANTS},
                       figure=str(figure), engine={"name": c.engine, "build": build, "settings": {}},
                       computed_by=build)
    print_table(doc, server.title)
    return doc


def admitted(concurrency: int | None) -> dict:
    """serve's --concurrency as the server asks for bench-serve ({}: serve's default)."""
    return {} if concurrency is None else {"concurrency": concurrency}


def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def request_prompts(tokenizer, data: str, count: int, mean: int, seed: int) -> list[list[int]]:
    """`count` token-id prompts of about `mean` tokens (uniform within ±SPREAD), cut in order from the evaluation
    documents of `data` (several documents joined when one is shorter)."""
    from ridgefill.runtime.data import documents_for, load_corpus

    rng = np.random.default_rng(seed)
    lengths = [max(2, int(round(mean * rng.uniform(1 - SPREAD, 1 + SPREAD)))) for _ in range(count)]
    need = sum(lengths)
    tokens: list[int] = []
    for doc in documents_for(load_corpus(data), "evaluation"):
        tokens += tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(tokens) >= need:
            break
    if len(tokens) < need:
        raise RidgefillError(f"--data {data} has {len(tokens):,} tokens of evaluation text, fewer than the "
                             f"{need:,} that {count} prompts of about {mean} tokens need: lower --requests or "
                             "--prompt-tokens, or give more text")
    starts = np.cumsum([0, *lengths[:-1]])
    return [tokens[s:s + n] for s, n in zip(starts, lengths)]


def summary(variant: str, rate: float, outputs: list[dict], slo: float, seed: int = 0) -> dict:
    """One variant at one rate: TTFT percentiles (each with a seeded bootstrap interval over its requests), mean
    TPOT, throughput and goodput."""
    ttft = np.array([o["ttft"] for o in outputs])
    tpot = [(o["latency"] - o["ttft"]) / (o["output_tokens"] - 1) for o in outputs if o["output_tokens"] > 1]
    duration = max(o["start"] + o["latency"] for o in outputs) - min(o["start"] for o in outputs)
    return {"rate": rate, "variant": variant, "requests": len(outputs),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": float(ttft.mean()),
            "tpot_mean_s": float(np.mean(tpot)) if tpot else None, "duration_s": duration,
            "throughput_rps": len(outputs) / duration, "goodput_rps": int((ttft <= slo).sum()) / duration,
            "within_slo": int((ttft <= slo).sum()), "ttfts_s": ttft.tolist(),
            "ttft_intervals_s": {f"p{q}": percentile(ttft, q, seed=seed).to_dict() for q in (50, 90, 99)}}


def ttft_ratio(rate: float, exact: list[dict], ridge: list[dict], seed: int) -> dict:
    """RidgeFill's TTFT p50 over the stock server's at one rate, with a paired bootstrap interval (request i is the same
    prompt under both)."""
    iv = ratio_of_medians([o["ttft"] for o in ridge], [o["ttft"] for o in exact], seed=seed)
    return {"rate": rate, "ttft_p50_ratio": iv.estimate, "interval": iv.to_dict()}


def plot(results: list[dict], path: Path, slo: float, title: str) -> None:
    from ridgefill.runtime.figures import COLORS, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for variant in VARIANTS:
        rows = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        for key, style in (("ttft_p50_s", "-"), ("ttft_p90_s", "--"), ("ttft_p99_s", ":")):
            ax.plot(rates, [r[key] for r in rows], style, marker="o", color=COLORS[variant],
                    label=f"{'stock ' + title if variant == 'exact' else 'RidgeFill'} {key.split('_')[1]}")
    ax.axhline(slo, color="#999999", linewidth=0.8, label=f"TTFT objective {slo:g} s")
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("time to first token (s)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def with_interval(result: dict, q: int) -> str:
    """TTFT's q-th percentile with its 95 % interval, e.g. `1.23 [1.10, 1.41]` (no bounds from one request)."""
    iv = result["ttft_intervals_s"][f"p{q}"]
    bounds = f" [{iv['low']:.3g}, {iv['high']:.3g}]" if math.isfinite(iv["low"]) else ""
    return f"{iv['estimate']:.3g}{bounds}"


def print_table(doc: dict, title: str) -> None:
    ratios = {r["rate"]: r for r in doc["ratios"]}
    rows = []
    for r in doc["results"]:
        ratio = ratios[r["rate"]]
        iv = ratio["interval"]
        rows.append([f"{r['rate']:g}", r["variant"], *(with_interval(r, q) for q in (50, 90, 99)),
                     r["tpot_mean_s"], r["throughput_rps"], r["goodput_rps"],
                     f"{ratio['ttft_p50_ratio']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]" if r["variant"] == "ridge"
                     else ""])
    table(f"bench-serve: RidgeFill in {title} against stock {title} (seconds; rates in requests/s)",
          ["rate", "variant", "TTFT p50 [95% CI]", "TTFT p90 [95% CI]", "TTFT p99 [95% CI]", "TPOT", "throughput", "goodput",
           "TTFT p50 fill/stock [95% CI]"], rows)


COMMAND = Command("bench-serve", BenchServeConfig, run, extra_args="server_args")
