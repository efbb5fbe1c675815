"""`ridgefill splice`: which part of the filled cache carries the fill's error.

Per prompt, the non-tail rows (the prefix) are prefilled twice: exactly, and with the fill plan (`PrefixPlan`:
the prefix rows are treated exactly as in a one-call filled prefill of the whole prompt, keep_rows run in
full, every other row is filled). The two caches differ only in the filled layers S..L-1, at the filled rows
and at any keep row after the first filled one (it attended to filled entries): with the default keep_rows
(the leading sink rows) that is exactly the filled rows. A *splice* clones the filled cache and, over a layer
range and at those rows only, replaces one or more components by the exact cache's:

- keys, values: the attention layers' keys or values;
- key-scale: the exact per-head key norms with the filled directions; key-direction: the reverse (filled norms,
  exact directions); both together give the exact keys (norms are taken after RoPE, a rotation);
- state: the recurrent and conv state of linear-attention layers (hybrid models; a state summarises every
  row, so it is swapped whole).

Swaps combine with '+' (e.g. keys+values). The tail rows then run in full on top of each spliced cache and are
scored teacher-forced on the whole tail and on the distant-context tokens of `ridgefill loss` (marked with the
exact model), and optionally on needle retrieval from the filled region (RULER prompts, greedy decoding).
For each splice: the share of the fill's gap to exact that it closes, (fill − spliced) / (fill − exact), with
paired bootstrap intervals over passages (NLL) or needle prompts (retrieval).

It runs on torchfill alone (no --engine): it reads, copies and splices the caches of torchfill's runner.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from ridgefill.backends.torchfill import TorchfillBackend
from ridgefill.commands import Command, option
from ridgefill.torchfill import Cache, Runner, FillPlan
from ridgefill.errors import RidgefillError
from ridgefill.evals.common import start
from ridgefill.evals.decode import greedy_after_cache
from ridgefill.evals.passages import (PassageConfig, evaluation_passages, nll_results,
                                      tail_difference)
from ridgefill.evals.ruler import TASKS, build_samples, score_prediction
from ridgefill.method.fill import FROM_MAPS
from ridgefill.evals.scoring import continuation_nll, distant_tokens, short_context_nll
from ridgefill.runtime.stats import (describe_spread, distant_spread, format_interval, gap_closed, interval_dict,
                                   select)
from ridgefill.runtime.console import cell, progress_bar, table
from ridgefill.runtime.ranges import parse_ranges
from ridgefill.runtime.session import check_length

COMPONENTS = ("keys", "values", "key-scale", "key-direction", "state")
SPLICED = ("identity", "ridge", "mean")  # fills whose cache has the filled rows (drop writes none)
ATTENTION_SWAPS = "keys,values,key-scale,key-direction,keys+values"
STATE_SWAPS = "state,keys+values+state"


@dataclass
class SpliceConfig(PassageConfig):
    maps: Path | None = option(None, "Maps file (the ridge fill).", role="input")
    seed: int = option(0, "Bootstrap and needle seed.", top="seeds")
    swap: str | None = option(None, "Comma-separated swaps of keys, values, key-scale, key-direction, state; join "
                              "with '+' (default: each, and keys+values).", listed=str)
    layers: str | None = option(None, "Layer ranges to splice over, e.g. 16-29,20-29 (default: the filled range "
                                "S..L-1).", listed=str)
    by_quarter: bool = option(False, "Also splice over each quarter of the filled range.")
    samples: int = option(8, "Passages to score.")
    needles: int = option(0, "Needle prompts (needles in the filled region) to answer from each cache; 0 = NLL "
                          "only.")
    task: str = option("niah_single_1", "RULER task of the needle prompts.")
    max_new_tokens: int | None = option(None, "Cap on generated answer tokens (default: RULER's budget for the "
                                        "task).")
    fill: str | None = option(None, "The filled cache to splice: ridge, identity or the mean control (default: "
                              "ridge with --maps, else identity).")

    def check(self) -> None:
        super().check()
        if self.tail >= self.context:
            raise RidgefillError(f"--tail {self.tail} covers the whole --context {self.context}: nothing is filled, "
                                 "so there is nothing to splice; use a tail shorter than the context")
        if self.needles < 0:
            raise RidgefillError(f"--needles {self.needles} must be 0 (NLL only) or more")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise RidgefillError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.layers is not None:
            parse_layer_ranges(self.layers)
        if self.swap is not None:
            parse_swaps(self.swap)
        if self.fill_used == "drop":
            raise RidgefillError("--fill drop writes no late-layer cache for its filled rows, so there is nothing to "
                                 "splice into: splice identity, mean or ridge (measure drop with ruler and loss)")
        if self.fill_used not in SPLICED:
            raise RidgefillError(f"--fill '{self.fill}' is unknown: use {', '.join(SPLICED)}")
        if self.needles and self.task not in TASKS:
            raise RidgefillError(f"--task '{self.task}' is unknown: use one of {', '.join(TASKS)}")

    def wants_input(self):
        return ("fill", self.fill, "use identity") if self.fill in FROM_MAPS else None

    @property
    def fill_used(self) -> str:
        return self.fill or ("ridge" if self.maps is not None else "identity")


def run(c: SpliceConfig) -> dict:
    """Prefill each passage's prefix exactly and filled, score the tail on the filled cache and on each splice."""
    fill = c.fill_used
    m = start("splice", c, ("exact", fill), engine=TorchfillBackend.name)
    check_length("--context", c.context, m.model.context_length)
    plan = m.plans[fill]
    runner = m.backend.runner
    has_state = set(runner.layer_kinds) != {"attention"}
    swaps = parse_swaps(c.swap) if c.swap is not None else \
        parse_swaps(ATTENTION_SWAPS + ("," + STATE_SWAPS if has_state else ""))
    if not has_state and any("state" in s for s in swaps):
        raise RidgefillError("--swap state needs a model with recurrent-state (linear-attention) layers; this "
                             "model has attention layers only: drop state from --swap")
    ranges_asked = None if c.layers is None else parse_layer_ranges(c.layers)
    ranges = layer_ranges(ranges_asked, c.by_quarter, plan.split, runner.n_layers)
    splices = [(parts, r) for r in ranges for parts in swaps]
    prompts = [] if c.needles == 0 else build_samples(
        m.model.tokenizer, c.task, c.context, c.needles, c.seed, region="filled", tail=c.tail,
        keep_first=c.keep_first, max_new_tokens=c.max_new_tokens)
    texts = evaluation_passages(m.model.tokenizer, c.data, c.context, c.samples, c.skip)

    nll, counts = _passage_nll(m.backend, texts, plan, fill, splices, c.short, c.stride, c.alpha, c.beta)
    answers = _retrieval(m.backend, prompts, plan, splices, fill) if prompts else None

    results, intervals = summarise(nll, counts, c.tail - 1, answers, fill, c.seed)
    spread = distant_spread(counts)
    doc = m.write(results, intervals, list(results), fill=fill, split=plan.split,
                  layer_ranges=[list(r) for r in ranges], swaps=[_components(p) for p in swaps],
                  short_stride_used=c.stride, distant_spread=spread)
    print_tables(results, intervals, swaps, ranges, fill, f"{len(texts)} passages of {c.context} tokens, tail "
                 f"{c.tail}, {describe_spread(spread)}" + (f", {len(prompts)} needles" if prompts else ""))
    return doc


COMMAND = Command("splice", SpliceConfig, run, writes=".json", reads="maps")


# --- options ------------------------------------------------------------------------------------------
def parse_swaps(text: str) -> list[frozenset]:
    """'keys,values,key-scale+key-direction' -> one set of components per comma-separated swap."""
    swaps = []
    for item in text.split(","):
        parts = frozenset(p.strip() for p in item.split("+") if p.strip())
        unknown = sorted(parts - set(COMPONENTS))
        if not parts or unknown:
            raise RidgefillError(f"--swap '{text}': '{item.strip()}' is not a component; use {', '.join(COMPONENTS)}"
                                 " (join several with '+', e.g. keys+values)")
        if parts not in swaps:
            swaps.append(parts)
    return swaps


def parse_layer_ranges(text: str) -> list[tuple[int, int]]:
    """'16-29,20-29,25' -> [(16, 29), (20, 29), (25, 25)] (inclusive)."""
    return parse_ranges(text, "--layers", "layer", "16-29,20-29")


def layer_ranges(asked: list[tuple[int, int]] | None, by_quarter: bool, split: int,
                 n_layers: int) -> list[tuple[int, int]]:
    """The ranges to splice over: those asked (default: the whole filled range split..L-1), plus the four
    quarters of the filled range with `by_quarter`. Every range must lie inside the filled range."""
    if split >= n_layers:
        raise RidgefillError(f"split {split} fills no layer of this {n_layers}-layer model: nothing to splice")
    ranges = list(asked) if asked else [(split, n_layers - 1)]
    if by_quarter:
        ranges += [(int(q[0]), int(q[-1])) for q in np.array_split(np.arange(split, n_layers), 4) if len(q)]
    for a, b in ranges:
        if a < split or b >= n_layers:
            raise RidgefillError(f"--layers {a}-{b} is outside the filled range {split}-{n_layers - 1}: the filled "
                                 "and exact caches differ only there")
    return list(dict.fromkeys(ranges))


def label(parts: frozenset, layer_range: tuple[int, int]) -> str:
    return f"{_components(parts)}@{layer_range[0]}-{layer_range[1]}"


# --- caches -------------------------------------------------------------------------------------------
class PrefixPlan(FillPlan):
    """The fill plan of a prompt prefix whose tail runs in a later prefill call. Its rows are treated exactly as
    the same rows of a one-call filled prefill of the whole prompt: keep_rows run in full, the others are
    filled. (FillPlan insists on a full last row because a prompt's last row gives the next token's logits; a
    prefix needs no logits, and running its last row in full would make it differ from the one-call prefill.)"""

    def __init__(self, plan: FillPlan) -> None:
        super().__init__(**{f.name: getattr(plan, f.name) for f in fields(plan)})  # every setting, the tally shared

    def full_rows(self, n: int) -> torch.Tensor:
        # rows 0..n-1 of a prompt of n + tail rows: only keep_rows among them run in full
        return super().full_rows(n + self.tail)[:n]


@dataclass
class PrefixPair:
    exact: Cache
    filled: Cache
    rows: torch.Tensor  # [P] bool: the prefix rows whose entries can differ (see `differing_rows`)


def prefix_pair(runner: Runner, prefix: torch.Tensor, plan: FillPlan, capacity: int = 0) -> PrefixPair:
    """Prefill the prefix rows `prefix` [1, P] exactly and with `plan`'s filler and keep_rows."""
    prefix_plan = PrefixPlan(plan)
    exact = runner.prefill(prefix, logits_at=[], capacity=capacity).cache
    filled = runner.prefill(prefix, fill=prefix_plan, logits_at=[], capacity=capacity).cache
    return PrefixPair(exact, filled, differing_rows(prefix_plan.full_rows(prefix.shape[1])))


def differing_rows(full: torch.Tensor) -> torch.Tensor:
    """[P] bool from the full-row mask [P]: every row from the first filled row on. Filled rows hold predicted
    entries; a full (keep) row after them attended to those entries in the late layers, so its own late-layer
    entries differ from exact too. Only the leading full rows (the attention sink) match the exact cache."""
    return (~full).cumsum(0) > 0


def candidates(pair: PrefixPair, fill: str, splices) -> list:
    """(name, function making the cache) for the filled cache and each splice, in the order they are reported."""
    return [(fill, pair.filled.clone)] + [(label(p, r), lambda p=p, r=r: splice(pair, p, r)) for p, r in splices]


def splice(pair: PrefixPair, parts: frozenset, layer_range: tuple[int, int]) -> Cache:
    """A clone of the filled cache with `parts` taken from the exact cache over layers a..b (inclusive), at the
    rows where the two can differ (`pair.rows`)."""
    unknown = sorted(set(parts) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"unknown components {unknown}")
    out = pair.filled.clone()
    for layer in range(layer_range[0], layer_range[1] + 1):
        filled, exact = pair.filled[layer], pair.exact[layer]
        if filled.kind == "attention":
            keys = spliced_keys(filled.keys, exact.keys, parts)
            values = exact.values if "values" in parts else filled.values
            rows = pair.rows.to(filled.keys.device).view(1, 1, -1, 1)
            out[layer].replace(keys=torch.where(rows, keys, filled.keys),
                               values=torch.where(rows, values, filled.values))
        elif "state" in parts:
            out[layer].replace(recurrent=exact.recurrent, conv=exact.conv)
    return out


def spliced_keys(filled: torch.Tensor, exact: torch.Tensor, parts: frozenset) -> torch.Tensor:
    """Keys [B, Hkv, T, D] rebuilt as (norm source) x (direction source) per head and position: key-scale takes
    the norms from `exact`, key-direction the directions; keys takes both as they are."""
    if "keys" in parts:
        return exact
    if "key-scale" not in parts and "key-direction" not in parts:
        return filled
    norm_from = exact if "key-scale" in parts else filled
    direction_from = exact if "key-direction" in parts else filled
    norm = direction_from.norm(dim=-1, keepdim=True)  # [B, Hkv, T, 1]
    direction = direction_from / norm.clamp_min(torch.finfo(norm.dtype).tiny)
    return direction * norm_from.norm(dim=-1, keepdim=True)


# --- measurements -------------------------------------------------------------------------------------
def _passage_nll(backend, texts: list[list[int]], plan: FillPlan, fill: str, splices, short: int, stride: int,
                 alpha: float, beta: float) -> tuple[dict, list[int]]:
    """Per passage: tail NLL sums of the exact, filled and spliced caches over all tail tokens and over the
    distant-context tokens (marked with the exact model), and the distant token count."""
    runner = backend.runner
    nll = {name: {"tail": [], "distant": []} for name in ["exact", fill] + [label(p, r) for p, r in splices]}
    counts = []
    with progress_bar(f"splicing {len(texts)} passages", len(texts) * (len(splices) + 2)) as advance:
        for passage in texts:
            ids = torch.tensor([passage])
            n, tail = ids.shape[1], plan.tail
            pair = prefix_pair(runner, ids[:, : n - tail], plan, capacity=n)
            tail_ids = ids[:, n - tail :]
            exact = continuation_nll(runner, pair.exact.clone(), tail_ids)[0].float().cpu()  # [tail-1]
            key = distant_tokens(exact, short_context_nll(backend, ids, tail, short, stride, exact), alpha, beta)
            counts.append(int(key.sum()))
            for name, make in [("exact", None)] + candidates(pair, fill, splices):
                scores = exact if make is None else continuation_nll(runner, make(), tail_ids)[0].float().cpu()
                nll[name]["tail"].append(float(scores.sum()))
                nll[name]["distant"].append(float(scores[key].sum()))
                advance()
    return nll, counts


# --- needle retrieval ---------------------------------------------------------------------------------
def _retrieval(backend, samples, plan: FillPlan, splices, fill: str) -> dict[str, list[float]]:
    """Score (0..100) of greedy answers to filled-region needle prompts from the exact, filled and spliced caches."""
    runner, tokenizer = backend.runner, backend.model.tokenizer
    scores = {name: [] for name in ["exact", fill] + [label(p, r) for p, r in splices]}
    with progress_bar(f"retrieving {len(samples)} needles", len(samples) * len(scores)) as advance:
        for s in samples:
            ids = torch.tensor([s.input_ids])
            pair = prefix_pair(runner, ids[:, : s.tail_start], plan, capacity=ids.shape[1] + s.max_new_tokens)
            for name, make in [("exact", pair.exact.clone)] + candidates(pair, fill, splices):
                tokens = greedy_after_cache(runner, make(), ids[:, s.tail_start :], s.max_new_tokens,
                                            tokenizer.eos_token_id)
                scores[name].append(score_prediction(s.task, tokenizer.decode(tokens, skip_special_tokens=True),
                                                     s.outputs))
                advance()
    return scores


# --- summaries ----------------------------------------------------------------------------------------
def summarise(nll: dict, counts: list[int], tail_tokens: int, retrieval: dict | None, fill: str,
              seed: int) -> tuple[dict, dict]:
    """Mean NLLs (tokens pooled over passages), retrieval, and for each splice the share of the fill's gap it
    closes. Per-passage NLL sums are compared directly: every variant is scored on the same tokens, so the
    token counts cancel in the share."""
    n_distant = sum(counts)
    results, intervals = {}, {}
    for name, s in nll.items():
        r = nll_results(s, counts, tail_tokens)
        if retrieval:
            r["retrieval"] = float(np.mean(retrieval[name]))
            r["per_needle"] = retrieval[name]
        results[name] = r
        if name == "exact":
            continue
        found = {"tail_nll_nats": tail_difference(s, nll["exact"], tail_tokens, seed)}
        if name != fill:
            found["gap_closed_tail"] = gap_closed(nll[fill]["tail"], s["tail"], nll["exact"]["tail"], seed=seed)
            if n_distant:  # resample only the passages that hold distant tokens
                keep = [c > 0 for c in counts]
                found["gap_closed_distant"] = gap_closed(select(nll[fill]["distant"], keep), select(s["distant"], keep),
                                                         select(nll["exact"]["distant"], keep), seed=seed)
            if retrieval:
                found["gap_closed_retrieval"] = gap_closed(retrieval[fill], retrieval[name], retrieval["exact"],
                                                           seed=seed)
        intervals[name] = {metric: interval_dict(iv) for metric, iv in found.items()}
        for metric in ("gap_closed_distant", "gap_closed_tail", "gap_closed_retrieval"):
            if metric in intervals[name]:
                r[metric] = intervals[name][metric]["estimate"]
    return results, intervals


def print_tables(results: dict, intervals: dict, swaps: list[frozenset], ranges: list[tuple[int, int]],
                 fill: str, title: str) -> None:
    retrieval = "retrieval" in results["exact"]
    metrics = ["distant", "tail"] + (["retrieval"] if retrieval else [])
    rows = []
    for name in ["exact", fill]:
        r = results[name]
        rows.append([name if name == "exact" else f"{fill} fill", "", cell(r["distant_nll"]), "",
                     r["tail_nll"], ""] + ([r["retrieval"], ""] if retrieval else []))
    for layer_range in ranges:
        for parts in swaps:
            name = label(parts, layer_range)
            r, iv = results[name], intervals[name]
            cells = [cell(r["distant_nll"]), format_interval(iv.get("gap_closed_distant"), percent=True),
                     r["tail_nll"], format_interval(iv.get("gap_closed_tail"), percent=True)]
            if retrieval:
                cells += [r["retrieval"], format_interval(iv.get("gap_closed_retrieval"), percent=True)]
            rows.append([_components(parts), f"{layer_range[0]}-{layer_range[1]}"] + cells)
    columns = ["swapped", "layers", "distant NLL", "gap closed [95% CI]", "tail NLL", "gap closed [95% CI]"]
    table(f"splice into the {fill} fill: {title}", columns + (["retrieval", "gap closed [95% CI]"] if retrieval
                                                               else []), rows)
    if len(ranges) > 1:
        metric = metrics[0] if results[fill]["distant_nll"] is not None else "tail"
        matrix = [[_components(p)] + [format_interval(intervals[label(p, r)].get(f"gap_closed_{metric}"),
                                                      bounds=False, percent=True)
                                      for r in ranges] for p in swaps]
        table(f"share of the {fill} fill's gap to exact closed ({metric} NLL), by component and layer range",
              ["swapped"] + [f"{a}-{b}" for a, b in ranges], matrix)


def _components(parts: frozenset) -> str:
    return "+".join(c for c in COMPONENTS if c in parts)
