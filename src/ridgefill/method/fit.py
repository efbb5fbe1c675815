"""`ridgefill fit`: per-layer maps in closed form from calibration statistics, and their held-out error."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from ridgefill import __version__
from ridgefill.commands import REQUIRED, Command, Config, option
from ridgefill.errors import RidgefillError
from ridgefill.runtime.stats import mean
from ridgefill.method.statistics import PARTS, Calibration, SplitStats, check_fittable
from ridgefill.method.maps import KINDS, save_maps
from ridgefill.method.maps_gguf import check_gguf_type, gguf_type_option
from ridgefill.method.ridge import RANK_BASES, fit_split, mean_split
from ridgefill.runtime.artifacts import load_artifact, read_meta
from ridgefill.runtime.console import note, progress_bar, table
from ridgefill.runtime.paths import check_output, write_json


@dataclass
class FitConfig(Config):
    stats: Path = option(REQUIRED, "Statistics from `ridgefill calibrate`.", role="input")
    out: Path = option(REQUIRED, "Maps file to write: .safetensors, or .gguf (the maps as a llama.cpp adapter); a JSON "
                       "summary goes beside it.", role="output")
    split: int | None = option(None, "Which split to fit (needed if the stats hold several).", top="splits")
    lam: str = option("auto", "'auto' (per layer, chosen on the validation rows) or a λ relative to "
                      "trace(Pxx)/H (Pxx: the centred XᵀX).", top="lam")
    kind: str = option("ridge", "ridge (fitted maps), identity (x itself, no fit) or mean (the null control: each "
                       "late layer's calibration mean, whatever the row).")
    rank: int | None = option(None, "Keep only r directions of each map's residual (low rank).")
    rank_basis: str = option(RANK_BASES[0], "With --rank: inputs (reduced-rank ridge: the directions that keep most "
                             "of the fitted predictions on the calibration inputs) or weights (the top singular "
                             "directions of the residual map).")
    targets: str = option("raw", "raw (each late layer's input y) or normalized (y/rms(y) rescaled to the mean "
                          "norm: every row weighs the same, as the layer's input norm sees it; needs "
                          "`calibrate --normalized-targets`).")
    gguf_type: str | None = gguf_type_option()

    def check(self) -> None:
        if self.kind not in KINDS:
            raise RidgefillError(f"unknown --kind '{self.kind}': use {' or '.join(KINDS)}")
        if self.rank_basis not in RANK_BASES:
            raise RidgefillError(f"unknown --rank-basis '{self.rank_basis}': use {' or '.join(RANK_BASES)}")
        if self.targets not in TARGETS:
            raise RidgefillError(f"unknown --targets '{self.targets}': use {' or '.join(TARGETS)}")
        _parse_lam(self.lam)
        check_gguf_type(self.out, self.gguf_type)
        check_output(self, beside=(".json",))


FIT_THREADS = 1  # torch threads of the fit's float64 algebra, whatever the process runs on (docs/recipes.md)


@contextmanager
def fixed_threads(threads: int = FIT_THREADS) -> Iterator[None]:
    """Torch (and MKL) run on `threads` threads inside, as before after. MKL's eigh and matmuls round differently on
    another thread count (measured: a 2-thread fit's held-out errors differed from a 1-thread fit's in the last
    digits), and the thread count moves with how a process was started (OMP_NUM_THREADS, pytest-xdist's workers, the
    cores it may use), so a fit on a fixed count is bit-identical wherever it runs on one machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(c: FitConfig) -> dict:
    """Fit one split's maps, print their held-out error beside identity fill's, write maps + JSON summary; on
    FIT_THREADS threads."""
    with fixed_threads():
        return _fit(c)


def _fit(c: FitConfig) -> dict:
    stats, out, kind, rank = c.stats, c.out, c.kind, c.rank
    lam_value = _parse_lam(c.lam)
    meta = read_meta(stats, "stats")
    split = _split_of(stats, meta["splits"], c.split)
    check_fittable([split], meta["n_layers"])
    hidden = meta["hidden_size"]
    if rank is not None and not 1 <= rank < hidden:
        raise RidgefillError(f"--rank {rank} is out of range: use 1..{hidden - 1}")
    tensors, _ = load_artifact(stats, "stats", prefix=f"s{split}.")  # only this split's statistics
    cal = Calibration.from_tensors([split], tensors, meta)
    _check_finite(stats, cal)
    train, val, test = (cal.stats.get((split, p)) for p in PARTS)
    if train.count < 2:
        raise RidgefillError(f"{stats} has only {train.count} training rows for split {split}: calibrate on more "
                             "tokens")
    means = train.ysum / train.count  # [L-S-1, H] each late layer's mean input, stored for the mean control
    if kind == "mean" and (rank is not None or c.targets != "raw" or train.lookback):
        raise RidgefillError("--kind mean fits no map: drop --rank and --targets, and calibrate without lookback")
    if c.targets == "normalized":
        train, val, test = _normalized(stats, train, val, test, hidden)
    if kind in ("identity", "mean"):
        lam_value = 1.0  # no map is fitted; the pass only measures identity fill's held-out error
    if lam_value == "auto" and val.count == 0:
        raise RidgefillError("--lam auto needs held-out rows: calibrate with --holdout > 0 or pass --lam 1e-3")
    errors_on = _errors_on(stats, val, test, lam_value == "auto")
    n_maps = meta["n_layers"] - split - 1
    if kind == "mean":
        fits = mean_split(train, test if test is not None and test.count else (val if val.count else None))
    else:
        with progress_bar(f"fitting split {split}", n_maps) as advance:
            fits = fit_split(train, val if val.count else None, lam_value, rank, advance, test, c.rank_basis)
    if kind == "identity":  # the stored map is x itself: its error is identity fill's
        fits = [replace(f, error_map=f.error_identity, error_full_rank=f.error_identity, lam=math.nan) for f in fits]
    base = {k: meta[k] for k in ("model", "data", "tokens", "seq_len")}
    lookback = train.lookback if kind == "ridge" else 0
    window = {"lookback": lookback, "lookback_start": meta.get("skip_first", 0)} if lookback else {}
    if meta.get("filled_window"):  # calibrated on windowed split states: the maps run only with that window
        window["filled_window"] = meta["filled_window"]
    save_maps(out, split, meta["n_layers"], fits, {**base, "stats": str(stats), "rank": rank,
                                                   "rank_basis": c.rank_basis if rank else None,
                                                   "targets": c.targets, "errors_on": errors_on, **window}, kind,
              means=means, gguf_type=c.gguf_type)
    rows = [[f.layer, f.lam, f.error_identity, f.error_map] for f in fits]
    label = {"ridge": "ridge", "identity": "identity (stored)", "mean": "mean (control)"}[kind]
    chosen = ", λ chosen on the validation rows" if lam_value == "auto" else ""
    space = ", normalised targets" if c.targets == "normalized" else ""
    space += f", lookback {lookback}" if lookback else ""
    table(f"{errors_on or 'held-out'} relative error ‖Ŷ−Y‖²/‖Y−Ȳ‖²{space}, split {split}{chosen} → {out}",
          ["layer", "λ (relative)", "identity fill", f"{label} map"], rows)
    summary = {"command": "fit", "maps": str(out), "kind": kind, "split": split, "rank": rank,
               "rank_basis": c.rank_basis if rank else None, "targets": c.targets, "lookback": lookback,
               "filled_window": meta.get("filled_window"), "model": meta["model"], "errors_on": errors_on,
               "lam_chosen_on": "validation" if lam_value == "auto" else None,
               "layers": [dict(zip(["layer", "lam", "error_identity", "error_map"], r)) for r in rows],
               "mean_error_identity": mean([f.error_identity for f in fits]),
               "mean_error_map": mean([f.error_map for f in fits]), "ridgefill_version": __version__}
    write_json(Path(str(out) + ".json"), summary)
    return summary


TARGETS = ("raw", "normalized")


def _normalized(stats: Path, train: SplitStats, val: SplitStats, test: SplitStats | None, hidden: int):
    """The three parts with normalised targets as Y: row y becomes y · s_l / rms(y), with s_l the root mean
    square of layer l's training targets (so the targets keep their overall scale and only the rows' relative
    weights change). Errors are then measured in that space too."""
    if not train.has_normalized:
        raise RidgefillError(f"{stats} has no normalised-target statistics: recalibrate with "
                             "--normalized-targets, or fit with --targets raw")
    scale = (train.yy / (train.count * hidden)).sqrt()  # [M]
    return tuple(p.normalized_targets(scale) if p is not None else None for p in (train, val, test))


def _check_finite(stats: Path, cal: Calibration) -> None:
    """Refuse statistics with a NaN or an infinity in any sum, before any solve (calibrate keeps rows that overflow
    out; such a file comes from an older ridgefill or was changed)."""
    for (split, part), st in cal.stats.items():
        name = st.nonfinite()
        if name:
            raise RidgefillError(f"{stats} holds a NaN or an infinity in split {split}'s {part} statistics "
                                 f"(s{split}.{part}.{name}): recalibrate (this ridgefill keeps rows that overflow "
                                 "out), in fp32")


def _split_of(stats: Path, splits: list[int], split: int | None) -> int:
    """The split to fit: the one asked for, or the file's only one."""
    if split is None:
        if len(splits) > 1:
            raise RidgefillError(f"{stats} holds splits {splits}: pass --split with one of them")
        return splits[0]
    if split not in splits:
        raise RidgefillError(f"{stats} has no statistics for split {split} (it has {splits}): recalibrate "
                             f"with --split {split}")
    return split


def _errors_on(stats: Path, val: SplitStats, test: SplitStats | None, auto: bool) -> str | None:
    """Which held-out rows the errors are measured on: "test" (rows that chose nothing), else "validation"
    (with a note: a file from before the test part, or too few held-out sequences), None without held-out rows."""
    if test is not None and test.count > 0:
        return "test"
    if val.count == 0:
        return None
    why = "it was written before held-out rows were split into validation and test" if test is None else \
        "too few held-out sequences"
    also = ", the rows that also chose λ (optimistic)" if auto else ""
    note(f"note: {stats} has no test rows ({why}): the errors are measured on the validation rows{also}")
    return "validation"


COMMAND = Command("fit", FitConfig, run, writes=".safetensors", summary_json=True, reads="stats", makes="maps")


def _parse_lam(lam):
    lam = str(lam)
    if lam == "auto":
        return "auto"
    try:
        value = float(lam)
    except ValueError:
        raise RidgefillError(f"--lam '{lam}' is neither 'auto' nor a number") from None
    if not value > 0:
        raise RidgefillError(f"--lam must be positive, got {lam}")
    return value

