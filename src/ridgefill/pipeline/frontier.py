"""The speed–quality frontier of a sweep over splits (and tails), and the *useful split*: what the pipeline
decides from a run folder's results (`ridgefill report` renders it, `ridgefill tune` judges its points).

Per variant (identity, ridge) and tail, each split is one point: its quality (filled-region RULER retrieval and
distant-context NLL, each beside exact's on the same samples) and its speed (FLOP-limit and measured prefill
speedup over exact, from bench-ttft). Seeds of one (split, tail) are averaged. Without a bench-ttft result for a
point, its FLOP-limit speedup is counted from the model's shapes (FlopModel, evals/flops.py) when they are known:
it needs no timing (flop_model: the shapes from the results' `model`, evals/flops.described_shape).

The useful split is the smallest split (the most layers filled, the most speed) whose filled-region retrieval
stays within `tolerance` points of exact: how much speed the method buys at equal quality.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill.defaults import DEFAULT_KEEP_FIRST
from ridgefill.method.fill import FILLS
from ridgefill.report.results import Result, read_json
from ridgefill.runtime.stats import mean

if TYPE_CHECKING:
    from ridgefill.torchfill import ModelShape


@dataclass
class Point:
    variant: str
    split: int
    tail: int
    retrieval: float | None = None  # RULER score (0-100), needles in filled rows
    retrieval_exact: float | None = None
    distant_nll: float | None = None  # mean NLL on distant-context tokens (tail NLL if the run found none)
    distant_nll_exact: float | None = None
    nll_metric: str | None = None  # "distant" or "tail": what distant_nll holds
    flop_speedup: float | None = None  # exact FLOPs / fill FLOPs at `length`
    measured_speedup: float | None = None  # exact TTFT / fill TTFT at `length`
    length: int | None = None  # prompt length of the speedups

    @property
    def retrieval_drop(self) -> float | None:
        if self.retrieval is None or self.retrieval_exact is None:
            return None
        return self.retrieval_exact - self.retrieval

    @property
    def distant_gap(self) -> float | None:
        """NLL above exact's (nats), on distant-context tokens (tail tokens where the run found none)."""
        if self.distant_nll is None or self.distant_nll_exact is None:
            return None
        return self.distant_nll - self.distant_nll_exact


@dataclass(frozen=True)
class FlopModel:
    """What a point's FLOP-limit speedup needs besides its variant, split and tail: the model's shapes, the prompt
    length it is stated at, the leading rows kept in full, and the maps' rank, lookback and filled window per split
    (absent: full rank, no lookback, full attention)."""

    shape: "ModelShape"
    length: int
    keep_first: int = DEFAULT_KEEP_FIRST
    ranks: dict = field(default_factory=dict)  # split -> rank of its maps (None: full rank)
    lookbacks: dict = field(default_factory=dict)  # split -> lookback K of its maps (0: x alone)
    windows: dict = field(default_factory=dict)  # split -> its maps' filled window {size, first, last} (absent: none)

    def speedup(self, variant: str, split: int, tail: int, window: dict | None = None) -> float | None:
        """FLOPs of exact prefill over those of the filled one (None for a model whose FLOPs are not counted:
        hybrid layers, or no MLP width); window {size, first, last}: the filled rows' window (default: the maps')."""
        import torch

        from ridgefill.torchfill import FilledWindow
        from ridgefill.torchfill.rows import full_positions
        from ridgefill.evals.flops import prefill_flops

        if not self.shape.dense or self.shape.intermediate is None:
            return None
        window = window or self.windows.get(split)
        full = full_positions(torch.arange(self.length), self.length, tail, self.keep_first).numpy()
        filled = prefill_flops(self.shape, self.length, full, split,
                               map_flops(self.shape, variant, split, self.ranks.get(split),
                                         self.lookbacks.get(split, 0)), variant == "drop",
                               FilledWindow(**window, sinks=self.keep_first) if window else None)
        return prefill_flops(self.shape, self.length) / filled


def map_flops(shape: "ModelShape", variant: str, split: int, rank: int | None = None, lookback: int = 0) -> int:
    """One filled row's maps (the filler's flops_per_row): none for identity fill and the controls (drop, mean),
    else engine.maps_flops over the predicted layers S+1..L-1."""
    from ridgefill.torchfill.fillers import maps_flops

    if variant != "ridge":
        return 0
    return maps_flops(shape.hidden, shape.layers - split - 1, rank, lookback)


@dataclass
class Frontier:
    points: list[Point] = field(default_factory=list)
    useful: list[tuple[str, int, Point | None]] = field(default_factory=list)  # (variant, tail, useful point)

    @property
    def splits(self) -> list[int]:
        return sorted({p.split for p in self.points})


def useful_split(points: list[Point], tolerance: float = 5.0) -> Point | None:
    """The point with the smallest split whose retrieval is within `tolerance` points of exact (None if none is)."""
    within = [p for p in points if p.retrieval_drop is not None and p.retrieval_drop <= tolerance]
    return min(within, key=lambda p: p.split) if within else None


def frontier(ruler: list, loss: list, bench: list, tolerance: float = 5.0, flops: FlopModel | None = None) -> Frontier:
    """Points from result documents (report.Result objects: .doc, .split, .tail) of ruler (filled region only),
    loss and bench-ttft; the useful split per (variant, tail) wherever retrieval was measured. flops: counts the
    FLOP-limit speedup of the points bench-ttft did not time (at flops.length)."""
    points: dict[tuple, Point] = {}

    def point(variant: str, split, tail) -> Point:
        return points.setdefault((variant, split, tail), Point(variant, split, tail))

    for (split, tail), docs in _by_config([r for r in ruler if r.config.get("region") == "filled"]).items():
        for v in FILLS:
            if all(v in d["results"] and "exact" in d["results"] for d in docs):
                p = point(v, split, tail)
                p.retrieval = mean([d["results"][v]["score"] for d in docs])
                p.retrieval_exact = mean([d["results"]["exact"]["score"] for d in docs])
    for (split, tail), docs in _by_config(loss).items():
        for v in FILLS:
            if all(v in d["results"] and "exact" in d["results"] for d in docs):
                metric = "distant_nll" if all(d["results"]["exact"]["distant_nll"] is not None for d in docs) \
                    else "tail_nll"
                p = point(v, split, tail)
                p.distant_nll = mean([d["results"][v][metric] for d in docs])
                p.distant_nll_exact = mean([d["results"]["exact"][metric] for d in docs])
                p.nll_metric = metric.removesuffix("_nll")
    for (split, tail), docs in _by_config(bench).items():
        for v in FILLS:
            found = [_speedup(d, v) for d in docs]
            found = [f for f in found if f is not None]
            if found:
                p = point(v, split, tail)
                p.length = found[0][0]
                p.flop_speedup = mean([f[1] for f in found if f[0] == p.length])
                p.measured_speedup = mean([f[2] for f in found if f[0] == p.length])
    if flops is not None:
        for p in (p for p in points.values() if p.flop_speedup is None):
            counted = flops.speedup(p.variant, p.split, p.tail)
            if counted is not None:
                p.flop_speedup, p.length = counted, flops.length
    ordered = sorted(points.values(), key=lambda p: (p.variant, p.tail, p.split))
    useful = []
    for v in FILLS:
        for tail in sorted({p.tail for p in ordered if p.variant == v and p.retrieval is not None}):
            useful.append((v, tail, useful_split([p for p in ordered if p.variant == v and p.tail == tail],
                                                  tolerance)))
    return Frontier(ordered, useful)


def _by_config(results: list) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in results:
        if r.split is not None and r.tail is not None:
            out.setdefault((r.split, r.tail), []).append(r.doc)
    return out


def _speedup(doc: dict, variant: str) -> tuple[int, float | None, float | None] | None:
    """(length, FLOP-limit speedup, measured speedup) of `variant` at the longest prompt a bench-ttft document
    timed; None if it did not time that variant."""
    entries = [e for e in doc.get("results", []) if variant in e.get("fill", {})]
    if not entries:
        return None
    longest = max(entries, key=lambda e: e["length"])
    fill = longest["fill"][variant]
    return longest["length"], fill.get("limit_speedup"), fill.get("speedup")


# --- the FLOP count of a sweep without bench-ttft ----------------------------------------------------------------
def flop_model(manifest: dict | None, results: list[Result]) -> FlopModel | None:
    """The model's shapes and the sweep's longest measured prompt (RULER length or loss context), so the frontier
    can count the FLOP-limit speedup of points that bench-ttft did not time, with the maps' rank, lookback and
    filled window per split (the window: the maps', else the one the split's results asked for); None when the
    shapes are unknown."""
    from ridgefill.evals.flops import described_shape

    models = [(manifest or {}).get("model")] + [r.doc.get("model") for r in results]
    shape = next((described_shape(m, _model_config(str(m.get("id", "")))) for m in models if isinstance(m, dict)),
                 None)
    measured = [r for r in results if r.command in ("ruler", "loss")]
    lengths = [int(s["length"]) for r in measured for s in r.doc.get("samples") or [] if s.get("length")]
    lengths += [int(r.config["context"]) for r in measured if r.config.get("context")]
    if shape is None or not lengths:
        return None
    keep_first = next((r.config["keep_first"] for r in measured if r.config.get("keep_first") is not None), 1)
    fits = [r for r in results if r.command == "fit"]
    ranks = {r.doc["split"]: r.doc.get("rank") for r in fits}
    lookbacks = {r.doc["split"]: r.doc.get("lookback", 0) for r in fits}
    windows = {r.split: measured_window(r) for r in measured if r.split is not None and r.config.get("filled_window")}
    windows.update({r.doc["split"]: r.doc["filled_window"] for r in fits if r.doc.get("filled_window")})
    return FlopModel(shape, max(lengths), keep_first, ranks, lookbacks, windows)


def measured_window(result: Result) -> dict:
    """The filled window a ruler or loss result asked for (--filled-window, --filled-window-layers), as FlopModel
    takes it: so points without windowed maps (identity fill) are counted with it too."""
    from ridgefill.torchfill import parse_layers

    first, last = parse_layers(result.config.get("filled_window_layers"), result.split)
    return {"size": result.config["filled_window"], "first": first, "last": last}


def _model_config(model_id: str) -> dict:
    """config.json of a local model folder, of the embedded model's converted folder, or of a Hub id in the local
    Hub cache (never loaded or downloaded); {} when none is here."""
    from ridgefill.runtime.models import ALIASES
    from ridgefill.runtime.paths import cache_dir

    found = cache_dir() / "models" / model_id if model_id in ALIASES else Path(model_id).expanduser()
    path = found / "config.json"
    if not path.is_file() and model_id.count("/") == 1:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_id, "config.json")
            path = Path(cached) if isinstance(cached, str) else path
        except (ImportError, OSError, ValueError):  # no Hub library, cache or valid id: no FLOP count
            pass
    config = read_json(path) if path.is_file() else None
    return config if isinstance(config, dict) else {}
