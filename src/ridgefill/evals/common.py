"""What every measurement shares: its common options, the one loop that runs the variants side by side, and the
JSON result document it writes (schema in docs/results-schema.md).

A measurement command's run is:

    m = start("loss", config, names)          # result clock, model + engine, the variants' plans, exact store
    for sample in m.progress(samples, "scoring", per_sample=len(m.plans)) ...   # or m.answers(...)
    doc = m.write(results, intervals, **extra)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ridgefill import __version__
from ridgefill.backends import DEFAULT_ENGINE, backend_class
from ridgefill.backends.base import Backend
from ridgefill.commands import REQUIRED, option
from ridgefill.torchfill import FillPlan
from ridgefill.errors import RidgefillError
from ridgefill.evals.exact_store import ExactStore
from ridgefill.method.fill import FROM_MAPS, FillOptions, variant_fills, variant_plans
from ridgefill.runtime.console import note, progress_bar
from ridgefill.runtime.paths import check_output, write_json
from ridgefill.runtime.session import ModelConfig, ModelFacts


# --- options ------------------------------------------------------------------------------------------------
@dataclass
class MeasureConfig(FillOptions, ModelConfig):
    """The options of every command that measures variants of prefill against exact (the fill's: FillOptions)."""

    seed: int = option(0, "Bootstrap seed.", top="seeds")
    out: Path = option(REQUIRED, "Result JSON to write.", role="output")

    def check(self) -> None:
        super().check()
        check_output(self)

    def wants_input(self):
        variants = getattr(self, "variants", None)
        named = [v.strip() for v in str(variants).split(",")] if variants is not None else []
        needs = [v for v in FROM_MAPS if v in named]
        return ("variants", needs[0], f"leave {needs[0]} out") if needs else None


def variants_option() -> Any:
    return option(None, "Comma-separated: exact, identity, ridge (default: all; ridge only with --maps).",
                  listed=str)


def exact_cache_option() -> Any:
    return option(None, "Folder that keeps exact results by sample, so runs on the same samples (e.g. other "
                  "splits) reuse them (recipes set it in the run folder).", role="store", keyed=False)


def parse_lengths(text: str, minimum: int = 1) -> list[int]:
    """--lengths: comma-separated token counts of at least `minimum`, sorted, without repeats."""
    try:
        values = sorted({int(v) for v in str(text).split(",") if v.strip()})
    except ValueError:
        raise RidgefillError(f"--lengths '{text}' is not a comma-separated list of integers") from None
    if not values or values[0] < minimum:
        raise RidgefillError(f"--lengths '{text}' must list lengths of at least {minimum} tokens, e.g. 2048,4096")
    return values


# --- the variant loop ---------------------------------------------------------------------------------------
@dataclass
class Measurement:
    """A measurement under way: the engine (backend) and its model, the fills and plans measured side by side
    (exact first), the exact store."""

    config: MeasureConfig
    backend: Backend
    fills: dict
    plans: dict[str, FillPlan | None]
    maps_meta: dict | None
    store: ExactStore
    writer: "ResultWriter"

    @property
    def model(self) -> ModelFacts:
        """The model as the backend holds it (tokenizer, shape, context, identity)."""
        return self.backend.model

    @property
    def split(self) -> int | None:
        """The split measured: the maps' when they are given, else --split."""
        return self.maps_meta["split"] if self.maps_meta else self.config.split

    def progress(self, items: Sequence, description: str, per_item: int = 1) -> Iterator[tuple[Any, Callable]]:
        """(item, advance) for each item, with one progress bar of len(items) * per_item steps."""
        with progress_bar(description, len(items) * per_item) as advance:
            for item in items:
                yield item, advance

    def answers(self, items: Sequence, description: str, kind: str, key: Callable[[Any], dict],
                answer: Callable[[Any, str], Any]) -> dict[str, list]:
        """answer(item, variant name) for every item and variant, in order; the exact variant's answers go through
        the exact store under `kind` and key(item), so a sweep's other splits reuse them."""
        out: dict[str, list] = {name: [] for name in self.plans}
        for item, advance in self.progress(items, description, len(self.plans)):
            for name, plan in self.plans.items():
                out[name].append(self.store.get_exact(plan, kind, key(item), lambda name=name: answer(item, name)))
                advance()
        return out

    def fill_rows(self) -> dict:
        """Per fill variant: rows filled, and rows run in full instead because their split state was an outlier
        or their maps' lookback window was not whole (summed over every prompt); says so on stderr when there were
        any."""
        tallies = {name: self.backend.tally(name).to_dict() for name, plan in self.plans.items() if plan is not None}
        why = {"outlier_tokens": f"as split-state outliers (--outlier-factor {self.config.outlier_factor:g})",
               "lookback_full_tokens": "without a whole lookback window (the first rows of a chunk)"}
        for field, reason in why.items():
            counts = {name: t[field] for name, t in tallies.items() if t[field]}
            if counts:
                note(f"note: rows run in full {reason}: " + ", ".join(f"{n} {k}" for n, k in counts.items()))
        return tallies

    def filled_window(self) -> dict | None:
        """The filled rows' window the fills ran with ({size, first, last, sinks}; None: full attention), whether
        asked for or carried by the maps."""
        window = next((plan.window for plan in self.plans.values() if plan is not None), None)
        return None if window is None else {**window.to_meta(), "sinks": window.sinks}

    def write(self, results, intervals: dict, variants: list[str] | None = None, **extra) -> dict:
        """The result document, written atomically to --out (with the exact store's hits and misses). variants:
        the names its results hold (default: the plans measured)."""
        if hasattr(self.config, "exact_cache"):  # a command that keeps exact results says how many it reused
            extra = {"exact_store": self.store.summary(), **extra}
        extra = {"computed_by": self.backend.provenance(), "engine": engine_record(self.backend),
                 "fill_rows": self.fill_rows(), "filled_window": self.filled_window(), **extra}
        info = maps_info(self.config.maps, self.maps_meta)
        return self.writer.write(self.config.out, self.model.model_info, info,
                                 list(self.plans) if variants is None else variants, results, intervals, **extra)


def start(command: str, config: MeasureConfig, variants: Sequence[str], record: dict | None = None,
          projection: str = "auto", engine: str | None = None) -> Measurement:
    """Start the clock, open the engine (`engine`, else --engine, else the default engine for a command without the
    option) and its model, build the plans of `variants` at the config's split and tail. The command starts the
    backend (`with m.backend.start(longest):`), knowing how long its prompts are.
    record: the `config` of the result document (default: every option as given)."""
    writer = ResultWriter(command, config.as_dict() if record is None else record, config.seed)
    backend = backend_class(engine or getattr(config, "engine", DEFAULT_ENGINE))(config, projection)
    model = backend.model
    fills = variant_fills(config, variants)
    plans, meta = variant_plans(model, config, variants)
    store = ExactStore(getattr(config, "exact_cache", None), model.model_info, config.dtype, config.device,
                       config.chunk, backend.store_scope(), backend.provenance())
    return Measurement(config, backend.use(fills, plans), fills, plans, meta, store, writer)


# --- the result document ------------------------------------------------------------------------------------
def engine_record(backend: Backend) -> dict:
    """The engine that ran, as a value (never in a key's name, so every engine's documents have the same keys):
    `name` (--engine), `build` (Backend.provenance: what computed the results) and `settings` (Backend.describe:
    the engine's own settings per variant; {} where it has none beyond the config)."""
    return {"name": backend.name, "build": backend.provenance(), "settings": backend.describe()}


def maps_info(path: str | Path | None, meta: dict | None) -> dict | None:
    """The maps a result was measured with: path, the first 16 hex digits of the sha256 of the bytes loaded, split,
    kind."""
    if path is None:
        return None
    meta = meta or {}
    return {"path": str(path), "hash": (meta.get("sha256") or "")[:16] or None, "split": meta.get("split"),
            "kind": meta.get("kind")}


class ResultWriter:
    """Start it when a command starts; `write` stamps the duration and writes the document atomically."""

    def __init__(self, command: str, config: dict, seed: int | None = None) -> None:
        self.command, self.config, self.seed = command, config, seed
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._t0 = time.perf_counter()

    def document(self, model: dict, maps: dict | None, variants: list[str], results, intervals: dict,
                 **extra) -> dict:
        return {
            "command": self.command,
            "model": model,
            "maps": maps,
            "config": self.config,
            "variants": variants,
            "results": results,
            "intervals": intervals,
            "seed": self.seed,
            "ridgefill_version": __version__,
            "started_at": self.started_at,
            "duration_s": time.perf_counter() - self._t0,
            **extra,
        }

    def write(self, path: str | Path, *args, **kwargs) -> dict:
        doc = self.document(*args, **kwargs)
        write_json(path, doc)
        return doc
