"""How to fill: the one settings type that every command, the recipe runner, tune and the vLLM plugin share.

A FillSettings names a fill variant (identity, ridge, or a null control: drop or mean), its split (maps carry
theirs), the maps file, the tail, the leading rows kept in full, the outlier rule and the filled rows' window below
the split (maps carry the one they were calibrated with). Each setting but the variant is one FillField
(method/fill_fields.py: its default, check, help, environment variable and serving.json key); from them come

- the plan (`plan`: torchfill.FillPlan, every engine's rows, with the maps loaded and checked against the model),
- (the vLLM plugin's environment is vLLM's translation of it: backends/vllm/fill.py),
- the fill part of a serving config (`to_serving`, `load_serving`: what `ridgefill tune` writes and `generate`,
  `bench-ttft` and `serve` read).

`FillOptions` holds the options that set it (one per FillField with help) for every command that fills
(measurements, generate, serve); `ServedOptions` adds `--serving-config` and its either-or rule (generate, serve,
bench-ttft).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill.commands import Config, option
from ridgefill.errors import RidgefillError
from ridgefill.method.fill_fields import (FIELDS, OPTIONS, check_fill, check_fill_values, check_window_values,
                                          with_fields)

if TYPE_CHECKING:
    from ridgefill.torchfill import FillPlan

VARIANTS = ("exact", "identity", "ridge", "drop", "mean")  # what a measurement can run side by side, exact first
FILLS = VARIANTS[1:]  # the fill variants
FROM_MAPS = ("ridge", "mean")  # variants that read a maps file (mean: its calibration means)
DEFAULT_VARIANTS = ("exact", "identity", "ridge")  # what runs without --variants (ridge only with --maps)
SERVING_KIND = "ridgefill-serving-config"
SERVING_HELP = ("A serving config from `ridgefill tune`: its fill (variant, split, maps, tail, keep-first, outlier "
                "factor) replaces those options.")


def resolve_window(window: int, layers: str | None, split: int, sinks: int, meta: dict | None, source=None):
    """The filled rows' window at `split` (torchfill.FilledWindow; None: full attention). With maps (`meta` their
    metadata, `source` their path) it is the one they were calibrated with: --filled-window may repeat it, not
    change it."""
    from ridgefill.torchfill import FilledWindow, parse_layers

    stored = (meta or {}).get("filled_window")
    if meta is not None:
        asked = (window, parse_layers(layers, split)) if window else None
        found = (stored["size"], (stored["first"], stored["last"])) if stored else None
        if asked is not None and asked != found:
            had = f"window {found[0]}, layers {found[1][0]}-{found[1][1]}" if found else "full attention"
            raise RidgefillError(f"{source} was calibrated with {had} for its filled rows, not --filled-window "
                                 f"{window} (layers {asked[1][0]}-{asked[1][1]}): drop --filled-window (the maps "
                                 "carry theirs) or calibrate and fit with it")
        return FilledWindow(stored["size"], stored["first"], stored["last"], sinks) if stored else None
    if not window:
        return None
    first, last = parse_layers(layers, split)
    return FilledWindow(window, first, last, sinks)


@dataclass(frozen=True)
@with_fields(f.name for f in FIELDS)
class FillSettings:
    """How to fill one prompt: `variant` identity, ridge, drop or mean (torchfill/fillers.py), then the FIELDS in their
    order: `split` (the maps', checked when given); `maps` (ridge and mean, or for vLLM any maps file, identity ones
    too); tail, keep_first, outlier_factor; `maps_sha256` the bytes every loader must find; the filled window."""

    variant: str

    def __post_init__(self) -> None:
        if self.variant not in FILLS:
            raise RidgefillError(f"unknown fill variant {self.variant!r}: use {' or '.join(FILLS)}")
        check_fill(**{f.name: getattr(self, f.name) for f in FIELDS})
        check_window_values(self.filled_window, self.filled_window_layers)
        if self.variant in FROM_MAPS and self.maps is None:
            raise RidgefillError(f"the {self.variant} variant needs --maps (from ridgefill fit): pass it, or fill "
                                 "with identity")
        if self.maps is None and self.split is None:
            raise RidgefillError(f"{self.variant} fill needs --split (or --maps, which carries it)")
        if self.maps is not None and not isinstance(self.maps, Path):
            object.__setattr__(self, "maps", Path(self.maps))

    # --- the plan ----------------------------------------------------------------------------------------------
    def plan(self, model, keep_rows=()) -> tuple["FillPlan", dict | None]:
        """The plan on `model` (runtime/session.ModelFacts, or a loaded Session: maps loaded and checked against
        it) and the maps' metadata (None for identity fill). keep_rows: rows run in full besides the first
        keep_first and the tail."""
        from ridgefill.torchfill import DropFiller, FillPlan, IdentityFiller
        from ridgefill.method.maps import check_for_model, load_filler, read_maps_meta
        from ridgefill.runtime.paths import file_sha256

        n_layers = model.shape.layers
        rows = tuple(sorted(set(keep_rows)))  # the first keep_first rows are the plan's keep_first (never a list)
        meta, split = None, self.split
        if self.variant in FROM_MAPS:
            filler, meta = load_filler(self.maps, model.model_info, self.split, model.dtype, model.device,
                                       self.maps_sha256, mean=self.variant == "mean", n_layers=n_layers)
            split = meta["split"]
        elif self.maps is not None:  # identity or drop at the maps' split: their metadata is enough
            meta = {**read_maps_meta(self.maps), "sha256": file_sha256(self.maps)}
            check_for_model(self.maps, meta, model.model_info, self.split, n_layers)
            split = meta["split"]
        if not 1 <= split <= n_layers:
            raise RidgefillError(f"split {split} is out of range: use 1..{n_layers} for this model")
        if self.variant == "identity":
            filler = IdentityFiller(split, n_layers)
        elif self.variant == "drop":
            filler = DropFiller(split, n_layers)
        window = self.window(split, meta)
        return FillPlan(filler, self.tail, rows, self.outlier_factor, window, self.keep_first), meta

    def window(self, split: int, meta: dict | None = None):
        """The filled rows' window at `split` (torchfill.FilledWindow, None: full attention); `meta`: the maps'
        metadata (read from --maps when not given)."""
        from ridgefill.method.maps import read_maps_meta

        if meta is None and self.maps is not None:
            meta = read_maps_meta(self.maps)
        return resolve_window(self.filled_window, self.filled_window_layers, split, self.keep_first, meta, self.maps)

    # --- serving configs -----------------------------------------------------------------------------------------
    def to_serving(self) -> dict:
        """The fill part of a serving config (the maps by absolute path and sha256)."""
        from ridgefill.runtime.paths import file_sha256

        maps = None
        if self.variant in FROM_MAPS:
            maps = {"path": str(Path(self.maps).resolve()), "sha256": self.maps_sha256 or file_sha256(self.maps)}
        return {"variant": self.variant, **{f.name: getattr(self, f.name) for f in FIELDS if f.served}, "maps": maps}

    def describe(self) -> dict:
        """Every setting, by name (the maps by path as given)."""
        return {"variant": self.variant, **{f.name: getattr(self, f.name) for f in FIELDS},
                "maps": None if self.maps is None else str(self.maps)}

    def options(self) -> dict:
        """The fill options (FillOptions' fields) these settings set."""
        return {name: getattr(self, name) for name in OPTIONS}


def parse_variants(text, maps) -> list[str]:
    """--variants: comma-separated names (or a list). Default: exact, identity and (with --maps) ridge; the null
    controls drop and mean run when named (mean needs --maps). Exact always runs, first: every difference is taken
    against it."""
    if text is None:
        return [v for v in DEFAULT_VARIANTS if v != "ridge" or maps is not None]
    names = [v.strip() for v in (text.split(",") if isinstance(text, str) else text) if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown:
        raise RidgefillError(f"--variants '{text}' names unknown variant(s) {unknown}: use {', '.join(VARIANTS)}")
    needs = [v for v in FROM_MAPS if v in names]
    if needs and maps is None:
        raise RidgefillError(f"the {needs[0]} variant needs --maps (from ridgefill fit): pass it, or leave "
                             f"{needs[0]} out of --variants")
    return ["exact", *[v for v in VARIANTS if v in names and v != "exact"]]


def variant_fills(options, variants=VARIANTS) -> dict[str, "FillSettings | None"]:
    """The fills measured side by side: exact (None) and each fill variant of `options` (FillOptions: maps, split,
    tail, keep_first, outlier_factor), so every fill fills the same rows."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise RidgefillError(f"unknown variant(s) {unknown}: use {', '.join(VARIANTS)}")
    return {v: None if v == "exact" else FillSettings(v, **{name: getattr(options, name) for name in OPTIONS})
            for v in variants}


def variant_plans(model, options, variants=VARIANTS) -> tuple[dict, dict | None]:
    """The plans of variant_fills on `model` (FillSettings.plan). Given maps, every variant runs at the maps' split
    (--split is checked against it), also when ridge is not among them. Returns (plans, maps metadata)."""
    plans, meta = {}, None
    for v, fill in variant_fills(options, variants).items():
        if fill is None:
            plans[v] = None
            continue
        plans[v], found = fill.plan(model)
        meta = found or meta
    return plans, meta


def read_kind(maps) -> str | None:
    from ridgefill.method.maps import read_maps_meta

    return read_maps_meta(maps).get("kind")


@dataclass(frozen=True)
class Tuned:
    """A serving config: the fill it serves and the checkpoint it was tuned on."""

    fill: FillSettings
    weights_hash: str

    def check_model(self, weights_hash: str, path) -> None:
        """Refused for a model with other weights (ridge maps check this too; identity fill carries no maps)."""
        if self.weights_hash != weights_hash:
            raise RidgefillError(f"--serving-config {path} was tuned for another model (weights "
                                 f"{self.weights_hash}; this model's are {weights_hash}): tune this model, or pass "
                                 "its --model")


def load_serving(path: str | Path) -> Tuned:
    """Read and check a serving config (`ridgefill tune`'s serving.json). Its maps are named by path (absolute, or
    relative to the config's folder) and sha256: maps whose bytes changed since tune are refused. Anything missing or
    malformed is a one-line error."""
    from ridgefill.runtime.json_input import parse_json
    from ridgefill.runtime.paths import file_sha256, is_sha256, read_text

    text = read_text(path, "--serving-config")
    doc = parse_json(text, f"--serving-config {path}", "pass the file `ridgefill tune` wrote (serving.json)")
    if not isinstance(doc, dict) or doc.get("kind") != SERVING_KIND:
        raise RidgefillError(f"--serving-config {path} is not a ridgefill serving config: pass the serving.json "
                             "that `ridgefill tune` wrote")
    try:
        variant = doc["variant"]
        values = {f.name: doc[f.name] if f.served == "required" else doc.get(f.name, f.default)
                  for f in FIELDS if f.served}
        weights = doc["model"]["weights_hash"]
        maps = doc.get("maps")
        if not isinstance(weights, str) or not isinstance(variant, str):
            raise TypeError("model.weights_hash / variant")
    except (KeyError, TypeError) as exc:
        raise RidgefillError(f"--serving-config {path} lacks a valid {exc}: rerun `ridgefill tune`") from None
    if variant not in FILLS:
        raise RidgefillError(f"--serving-config {path}: unknown variant {variant!r}: rerun `ridgefill tune`")
    maps_path = sha = None
    if variant in FROM_MAPS:
        if not isinstance(maps, dict) or not isinstance(maps.get("path"), str):
            raise RidgefillError(f"--serving-config {path}: a {variant} fill without its maps (`maps.path`): rerun "
                                 "`ridgefill tune`")
        maps_path = Path(maps["path"])
        if not maps_path.is_absolute():
            maps_path = Path(path).parent / maps_path
        if not maps_path.is_file():
            raise RidgefillError(f"--serving-config {path}: its maps {maps_path} do not exist: rerun `ridgefill tune` "
                                 "or restore the file")
        sha = maps.get("sha256")
        if not is_sha256(sha):  # a prefix (an empty one, or 16 digits) would match other bytes
            raise RidgefillError(f"--serving-config {path}: its maps' sha256 {repr(sha)[:80]} is not a whole sha256 "
                                 "(64 hex digits): rerun `ridgefill tune` to pin the maps by their full sha256")
        found = file_sha256(maps_path)
        if found != sha.lower():
            raise RidgefillError(f"--serving-config {path}: its maps {maps_path} changed since tune (sha256 "
                                 f"{found[:16]}, the config says {sha[:16]}): rerun `ridgefill tune`")
        sha = found
    try:
        fill = FillSettings(variant, maps=maps_path, maps_sha256=sha, **values)
    except RidgefillError as exc:
        raise RidgefillError(f"--serving-config {path}: {exc}: rerun `ridgefill tune`") from None
    return Tuned(fill, weights)


# --- the options ------------------------------------------------------------------------------------------------
@dataclass
@with_fields(OPTIONS)
class FillOptions(Config):
    """The options of every command that fills, one per FillField with help (a recipe's top-level `splits` and
    `tails` set split and tail)."""

    def check(self) -> None:
        super().check()
        check_fill_values(self.tail, self.keep_first, self.outlier_factor)
        check_window_values(self.filled_window, self.filled_window_layers)

    def fill(self, variant: str | None = None) -> FillSettings:
        """The settings of `variant` (default: with --maps ridge, or mean for a mean maps file; else identity)."""
        if variant is None and self.maps is not None:
            variant = "mean" if read_kind(self.maps) == "mean" else "ridge"
        return FillSettings(variant or "identity", **{name: getattr(self, name) for name in OPTIONS})

    def with_serving(self, tuned: Tuned, **more):
        """These options with a serving config's fill in place of every fill option (and `more`)."""
        return replace(self, **tuned.fill.options(), **more)


@dataclass
class ServedOptions(FillOptions):
    """The fill options or a serving config (`--serving-config`, from `ridgefill tune`), one of the two: the options
    of generate, serve and bench-ttft."""

    serving_config: Path | None = option(None, SERVING_HELP)

    def check(self) -> None:
        super().check()
        check_fill_source(self, *self.source_rule())

    def source_rule(self) -> tuple[tuple[str, ...], str | None]:
        """check_fill_source's `also` and `needed` for this command (by default: nothing more, nothing needed)."""
        return (), None

    def served(self):
        """(these options with the serving config's fill in place, the serving config), or (self, None)."""
        if self.serving_config is None:
            return self, None
        tuned = load_serving(self.serving_config)
        return self.with_serving(tuned), tuned


def check_fill_source(c: ServedOptions, also: tuple[str, ...] = (), needed: str | None = None) -> None:
    """The either-or rule: a serving config sets the fill, so --maps, --split (and the options `also` names, e.g.
    variants) are refused beside it; `needed` (e.g. ", or pass --exact"; None: nothing is needed) says that one
    of --maps, --split and --serving-config must be given, and what else would do."""
    names = ("maps", "split", *also)
    if c.serving_config is not None and any(getattr(c, n) is not None for n in names):
        flags = [f"--{n.replace('_', '-')}" for n in names]
        raise RidgefillError(f"--serving-config sets the fill ({', '.join(names[:-1])} and {names[-1]}): drop "
                             f"{', '.join(flags[:-1])} and {flags[-1]}")
    if needed is not None and c.serving_config is None and c.maps is None and c.split is None:
        raise RidgefillError("give --maps (from ridgefill fit), --split (identity fill) or --serving-config (from "
                             f"ridgefill tune){needed}")
