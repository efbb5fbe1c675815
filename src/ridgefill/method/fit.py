"""`ridgefill fit`: per-layer maps in closed form from calibration statistics, and their held-out error."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ridgefill import __version__
from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import Calibration
from ridgefill.method.maps import KINDS, save_maps
from ridgefill.method.ridge import fit_split
from ridgefill.runtime.artifacts import load_artifact
from ridgefill.runtime.console import progress_bar, table
from ridgefill.runtime.paths import write_json


# --- fit ---------------------------------------------------------------------------------------------
def fit_command(stats, out, split, lam, kind, rank) -> dict:
    if kind not in KINDS:
        raise RidgefillError(f"unknown --kind '{kind}': use {' or '.join(KINDS)}")
    lam_value = _parse_lam(lam)
    tensors, meta = load_artifact(stats, "stats")
    splits = meta["splits"]
    if split is None:
        if len(splits) > 1:
            raise RidgefillError(f"{stats} holds splits {splits}: pass --split with one of them")
        split = splits[0]
    if split not in splits:
        raise RidgefillError(f"{stats} has no statistics for split {split} (it has {splits}): recalibrate "
                             f"with --split {split}")
    cal = Calibration.from_tensors(splits, tensors, meta)
    train, val = cal.stats[(split, "train")], cal.stats[(split, "val")]
    hidden = meta["hidden_size"]
    if rank is not None and not 1 <= rank < hidden:
        raise RidgefillError(f"--rank {rank} is out of range: use 1..{hidden - 1}")
    if train.count < 2:
        raise RidgefillError(f"{stats} has only {train.count} training rows for split {split}: calibrate on more tokens")
    if kind == "identity":
        lam_value = 1.0  # no map is fitted; the pass only measures identity fill's held-out error
    if lam_value == "auto" and val.count == 0:
        raise RidgefillError("--lam auto needs held-out rows: calibrate with --holdout > 0 or pass --lam 1e-3")
    n_maps = meta["n_layers"] - split - 1
    with progress_bar(f"fitting split {split}", n_maps) as advance:
        fits = fit_split(train, val if val.count else None, lam_value, rank, advance)
    if kind == "identity":  # the stored map is x itself: its error is identity fill's
        fits = [replace(f, error_map=f.error_identity, error_full_rank=f.error_identity, lam=math.nan) for f in fits]
    base = {k: meta[k] for k in ("model", "data", "tokens", "seq_len")}
    save_maps(out, split, meta["n_layers"], fits, {**base, "stats": str(stats), "rank": rank}, kind)
    rows = [[f.layer, f.lam, f.error_identity, f.error_map] for f in fits]
    label = "ridge" if kind == "ridge" else "identity (stored)"
    table(f"held-out relative error ‖Ŷ−Y‖²/‖Y−Ȳ‖², split {split} → {out}",
          ["layer", "λ (relative)", "identity fill", f"{label} map"], rows)
    summary = {"command": "fit", "maps": str(out), "kind": kind, "split": split, "rank": rank,
               "model": meta["model"], "layers": [dict(zip(["layer", "lam", "error_identity", "error_map"], r))
                                                  for r in rows],
               "mean_error_identity": _mean([f.error_identity for f in fits]),
               "mean_error_map": _mean([f.error_map for f in fits]), "ridgefill_version": __version__}
    write_json(Path(str(out) + ".json"), summary)
    return summary


def _parse_lam(lam: str):
    if lam == "auto":
        return "auto"
    try:
        value = float(lam)
    except ValueError:
        raise RidgefillError(f"--lam '{lam}' is neither 'auto' nor a number") from None
    if not value > 0:
        raise RidgefillError(f"--lam must be positive, got {lam}")
    return value


def _mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


