"""The core commands' workflows: calibrate, fit and generate. cli.py only parses options."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ridgefill import __version__
from ridgefill.artifacts import load_artifact
from ridgefill.calibrate import Calibration, run_calibration
from ridgefill.console import note, progress_bar, table
from ridgefill.data import documents_for, load_corpus, token_sequences
from ridgefill.errors import RidgefillError
from ridgefill.maps import KINDS, save_maps
from ridgefill.paths import write_json
from ridgefill.ridge import fit_split
from ridgefill.session import open_session, parse_splits


# --- calibrate ---------------------------------------------------------------------------------------
def calibrate_command(model, data, split, tokens, seq_len, out, resume, holdout, skip_first, outlier_factor,
                      checkpoint_every, dtype, device, chunk) -> Calibration:
    if tokens < 1 or seq_len < 2:
        raise RidgefillError("--tokens must be >= 1 and --seq-len >= 2")
    if not 0 <= holdout <= 0.5:
        raise RidgefillError(f"--holdout {holdout} is out of range: use a share between 0 and 0.5")
    session = open_session(model, dtype, device, chunk)
    splits = parse_splits(split, session.engine.n_layers)
    limit = session.engine.adapter.max_positions
    if limit and seq_len > limit:
        raise RidgefillError(f"--seq-len {seq_len} exceeds the model's context of {limit}: lower it")
    corpus = load_corpus(data)
    sequences = token_sequences(session.tokenizer, documents_for(corpus, "calibration"), seq_len, tokens)
    if not sequences:
        raise RidgefillError(f"data '{data}' yields no calibration sequence of {seq_len} tokens: give more text "
                             "or a smaller --seq-len")
    meta = {"model": {"id": model, "weights_hash": session.loaded.fingerprint}, "data": corpus.name,
            "tokens": len(sequences) * seq_len, "seq_len": seq_len}
    started = time.perf_counter()
    with progress_bar(f"calibrating splits {','.join(map(str, splits))}", len(sequences)) as advance:
        cal = run_calibration(session.engine, sequences, splits, out, meta, holdout, skip_first, outlier_factor,
                              checkpoint_every, resume, advance)
    rows = []
    for s in splits:
        tr, va = cal.stats[(s, "train")], cal.stats[(s, "val")]
        rows.append([s, tr.count, va.count, tr.skipped_first + va.skipped_first,
                     tr.skipped_outliers + va.skipped_outliers])
    table(f"calibration statistics → {out}", ["split", "train rows", "held-out rows", "sink rows skipped",
                                               "outlier rows skipped"], rows)
    summary = {"command": "calibrate", **cal.meta, "ridgefill_version": __version__,
               "duration_s": time.perf_counter() - started,
               "rows": [dict(zip(["split", "train_rows", "val_rows", "skipped_first", "skipped_outliers"], r))
                        for r in rows]}
    write_json(Path(str(out) + ".json"), summary)
    return cal


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


# --- generate ----------------------------------------------------------------------------------------
def generate_command(model, maps, split, tail, keep_first, exact, prompt, prompt_file, max_new_tokens, compare,
                     dtype, device, chunk) -> dict:
    if (prompt is None) == (prompt_file is None):
        raise RidgefillError("give exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        if not Path(prompt_file).is_file():
            raise RidgefillError(f"--prompt-file {prompt_file} does not exist")
        prompt = Path(prompt_file).read_text()
    if exact and compare:
        raise RidgefillError("--compare already runs exact: drop --exact")
    if not exact and maps is None:
        raise RidgefillError("filled prefill needs --maps (from ridgefill fit), or pass --exact")
    if max_new_tokens < 1:
        raise RidgefillError("--max-new-tokens must be at least 1")
    session = open_session(model, dtype, device, chunk)
    ids = session.tokenizer(prompt, return_tensors="pt", add_special_tokens=True)["input_ids"]
    if ids.shape[1] == 0:
        raise RidgefillError("the prompt is empty after tokenization")
    limit = session.engine.adapter.max_positions
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise RidgefillError(f"prompt ({ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceed the model's "
                             f"context of {limit}: shorten the prompt")
    plan = None
    if not exact:
        plan, _ = session.fill_plan(maps, split, tail, range(keep_first))
        if tail >= ids.shape[1]:
            note(f"note: tail {tail} >= prompt length {ids.shape[1]}: every row runs the full model (exact)")
    eos = session.tokenizer.eos_token_id
    runs = {}
    if exact or compare:
        runs["exact"] = session.engine.generate(ids, max_new_tokens, None, eos)
    if plan is not None:
        runs["filled"] = session.engine.generate(ids, max_new_tokens, plan, eos)
    texts = {k: session.tokenizer.decode(r.tokens[0], skip_special_tokens=True) for k, r in runs.items()}
    if compare:
        for name, r in runs.items():
            share = r.prefill.filled_share
            note(f"[{name}] ttft {r.ttft_s * 1000:.0f} ms, {share:.0%} of {ids.shape[1]} prompt rows filled")
            print(f"=== {name} ===\n{texts[name]}")
        note("outputs are identical" if texts["exact"] == texts["filled"] else "outputs differ")
    else:
        (name, r), = runs.items()
        note(f"ttft {r.ttft_s * 1000:.0f} ms, {r.prefill.filled_share:.0%} of {ids.shape[1]} prompt rows filled")
        sys.stdout.write(texts[name] + "\n")
    return texts
