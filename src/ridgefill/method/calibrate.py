"""`ridgefill calibrate`: one pass over calibration text into the statistics of method/statistics.py, with a
held-out share, checkpoints to `<out>.partial` and `--resume`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ridgefill import __version__
from ridgefill.commands import REQUIRED, Command, option
from ridgefill.engine import Engine
from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import Calibration, accumulate
from ridgefill.runtime.artifacts import load_artifact, save_artifact
from ridgefill.runtime.console import progress_bar, table
from ridgefill.runtime.data import documents_for, load_corpus, token_sequences
from ridgefill.runtime.paths import write_json
from ridgefill.runtime.session import ModelConfig, parse_splits


# --- the `calibrate` workflow ------------------------------------------------------------------------
def heldout_every(holdout: float) -> int:
    """Every k-th sequence is held out (k = round(1/holdout)); 0 means none."""
    return round(1 / holdout) if holdout > 0 else 0


def run_calibration(engine: Engine, sequences: list[list[int]], splits: list[int], out, meta: dict,
                    holdout: float = 0.1, skip_first: int = 1, outlier_factor: float = 20.0,
                    checkpoint_every: int = 8, resume: bool = False, advance=lambda n=1: None) -> Calibration:
    """Accumulate statistics over `sequences`, checkpointing to `<out>.partial` and resuming from it."""
    n_layers, hidden = engine.n_layers, engine.shape.hidden
    partial = Path(str(out) + ".partial")
    run_meta = {**meta, "artifact": "stats", "splits": sorted(splits), "holdout": holdout,
                "skip_first": skip_first, "outlier_factor": outlier_factor, "n_layers": n_layers,
                "hidden_size": hidden}
    cal = Calibration.empty(splits, n_layers, hidden)
    if resume and partial.exists():
        tensors, saved = load_artifact(partial, "stats")
        if any(saved.get(k) != v for k, v in run_meta.items()):
            raise RidgefillError(f"{partial} was written with other settings: rerun without --resume to start over")
        cal = Calibration.from_tensors(splits, tensors, saved)
        advance(cal.sequences_done)
    every = heldout_every(holdout)
    device = engine.device

    def save(path):
        save_artifact(path, cal.tensors(), {**run_meta, "sequences_done": cal.sequences_done,
                                             "tokens_done": cal.tokens_done})

    for i in range(cal.sequences_done, len(sequences)):
        part = "val" if every and i % every == every - 1 else "train"
        accumulate(engine, cal, torch.tensor([sequences[i]], device=device), part, skip_first, outlier_factor)
        advance()
        if checkpoint_every and (i + 1) % checkpoint_every == 0 and i + 1 < len(sequences):
            save(partial)
    save(out)
    partial.unlink(missing_ok=True)
    cal.meta = run_meta
    return cal


# --- the command ---------------------------------------------------------------------------------------------
@dataclass
class CalibrateConfig(ModelConfig):
    data: str = option(REQUIRED, "Text: .txt/.jsonl file or folder, Hub dataset, or 'wiki-leads' / 'shakespeare'.",
                       fallback="data")
    split: str = option(REQUIRED, "Split layer(s) S, comma-separated: one pass serves all.", listed=int,
                        top="splits")
    tokens: int = option(65536, "Calibration tokens (held-out share included).")
    seq_len: int = option(1024, "Tokens per calibration sequence.")
    out: Path = option(REQUIRED, "Statistics file (.safetensors) to write.", role="output")
    resume: bool = option(False, "Continue from <out>.partial after an interruption.", role="resume")
    holdout: float = option(0.1, "Share of sequences kept for validation (0..0.5).")
    skip_first: int = option(1, "Leading rows of each sequence kept out (sinks).")
    outlier_factor: float = option(20.0, "Drop rows whose split-state norm exceeds this x the median; 0 keeps all.")
    checkpoint_every: int = option(8, "Sequences between checkpoints.", keyed=False)

    def check(self) -> None:
        if self.tokens < 1 or self.seq_len < 2:
            raise RidgefillError("--tokens must be >= 1 and --seq-len >= 2")
        if not 0 <= self.holdout <= 0.5:
            raise RidgefillError(f"--holdout {self.holdout} is out of range: use a share between 0 and 0.5")


def run(c: CalibrateConfig) -> dict:
    """Calibrate, print the row counts per split and write the statistics with a JSON summary beside them."""
    session = c.open()
    splits = parse_splits(c.split, session.engine.n_layers)
    limit = session.context_length
    if limit and c.seq_len > limit:
        raise RidgefillError(f"--seq-len {c.seq_len} exceeds the model's context of {limit}: lower it")
    corpus = load_corpus(c.data)
    sequences = token_sequences(session.tokenizer, documents_for(corpus, "calibration"), c.seq_len, c.tokens)
    if not sequences:
        raise RidgefillError(f"data '{c.data}' yields no calibration sequence of {c.seq_len} tokens: give more "
                             "text or a smaller --seq-len")
    meta = {"model": {"id": c.model, "weights_hash": session.loaded.fingerprint}, "data": corpus.name,
            "tokens": len(sequences) * c.seq_len, "seq_len": c.seq_len}
    started = time.perf_counter()
    with progress_bar(f"calibrating splits {','.join(map(str, splits))}", len(sequences)) as advance:
        cal = run_calibration(session.engine, sequences, splits, c.out, meta, c.holdout, c.skip_first,
                              c.outlier_factor, c.checkpoint_every, c.resume, advance)
    rows = []
    for s in splits:
        tr, va = cal.stats[(s, "train")], cal.stats[(s, "val")]
        rows.append([s, tr.count, va.count, tr.skipped_first + va.skipped_first,
                     tr.skipped_outliers + va.skipped_outliers])
    table(f"calibration statistics → {c.out}", ["split", "train rows", "held-out rows", "sink rows skipped",
                                                 "outlier rows skipped"], rows)
    summary = {"command": "calibrate", **cal.meta, "ridgefill_version": __version__,
               "duration_s": time.perf_counter() - started,
               "rows": [dict(zip(["split", "train_rows", "val_rows", "skipped_first", "skipped_outliers"], r))
                        for r in rows]}
    write_json(Path(str(c.out) + ".json"), summary)
    return summary


COMMAND = Command("calibrate", CalibrateConfig, run, writes=".safetensors", summary_json=True, makes="stats")
