"""`ridgefill calibrate`: one streaming pass over calibration text into the statistics of method/statistics.py,
with a held-out share, checkpoints to `<out>.partial`, `--resume`, and several processes sharing the sequences
(torchrun, or `--nproc`: method/distributed.py). docs/calibration.md describes the statistics, checkpoints
and distributed use.

Sequence i (counted over the whole stream) is held out or not by i alone, and with W processes the sequences
from the start s of this run go round robin: i goes to rank (i − s) mod W. Every process keeps its own float64
sums on its model's device; at each checkpoint and at the end they are summed into rank 0's in place and the
other ranks start again from zero, so the statistics do not depend on W (up to float summation order) and a
partial file holds the global sums and the global number of sequences done: any W can resume it.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ridgefill import __version__
from ridgefill.commands import REQUIRED, Command, option
from ridgefill.torchfill import Runner
from ridgefill.errors import RidgefillError
from ridgefill.method.distributed import World, joined_world, relaunch
from ridgefill.method.fill import check_window_values, resolve_window
from ridgefill.method.statistics import HELD_OUT, OUTLIER_FACTOR, Calibration, accumulate, check_fittable
from ridgefill.runtime.artifacts import load_artifact, save_artifact
from ridgefill.runtime.console import note, progress_bar, table
from ridgefill.runtime.data import documents_for, documents_hash, iter_sequences, load_corpus, sequence_budget
from ridgefill.runtime.device import check_device
from ridgefill.runtime.paths import check_output, write_json
from ridgefill.runtime.provenance import code_hash
from ridgefill.runtime.session import ModelConfig, check_length, parse_splits

NAMES = ("data",)  # settings a resume checks by content (data_hash), not by name


# --- which sequences go where ---------------------------------------------------------------------------------
def heldout_every(holdout: float) -> int:
    """Every k-th sequence is held out (k = round(1/holdout)); 0 means none."""
    return round(1 / holdout) if holdout > 0 else 0


def part_of(index: int, every: int) -> str:
    """The part global sequence `index` goes to: every `every`-th is held out, alternately val and test."""
    if not every or index % every != every - 1:
        return "train"
    return HELD_OUT[(index // every) % len(HELD_OUT)]


class Checkpoints:
    """When to checkpoint: `every` sequences or `seconds` of wall time after the last checkpoint (0: that rule
    off; both 0: only the final write)."""

    def __init__(self, every: int = 0, seconds: float = 0.0, done: int = 0, clock=time.monotonic):
        self.every, self.seconds, self.clock = every, seconds, clock
        self.mark(done)

    def mark(self, done: int) -> None:
        self.last_done, self.last_time = done, self.clock()

    def due(self, done: int) -> bool:
        by_count = self.every > 0 and done - self.last_done >= self.every
        return by_count or (self.seconds > 0 and self.clock() - self.last_time >= self.seconds)


# --- starting, resuming, checkpointing ------------------------------------------------------------------------
def partial_path(out: str | Path) -> Path:
    return Path(str(out) + ".partial")


def partial_refusal(partial: Path, resume: bool, restart: bool) -> str | None:
    """Why a run may not start (None: it may): a plain rerun does not overwrite an interrupted run's checkpoint."""
    if partial.exists() and not (resume or restart):
        return f"{partial} holds an interrupted calibration: pass --resume to continue it or --restart to start over"
    return None


def start_calibration(runner: Runner, splits: list[int], partial: Path, run_meta: dict, resume: bool = False,
                      restart: bool = False, world: World = World(), normalized: bool = False,
                      lookback: int = 0) -> Calibration:
    """Zero statistics on the model's device, or on rank 0 with --resume the partial file's global sums, loaded
    onto that device; every process learns the number of sequences already done."""
    _check_same_settings(world, run_meta)
    cal, outcome = None, None
    if world.root:
        try:
            cal = _resumed(partial, run_meta, resume, restart, splits, runner.device)
            outcome = cal.sequences_done if cal is not None else 0
        except RidgefillError as exc:
            outcome = str(exc)
    outcome = world.from_root(outcome)
    if isinstance(outcome, str):
        raise RidgefillError(outcome if world.root else f"rank 0 cannot start: {outcome}")
    cal = cal or Calibration.empty(splits, runner.n_layers, runner.shape.hidden, runner.device, normalized, lookback)
    cal.sequences_done = outcome
    return cal


def _resumed(partial: Path, run_meta: dict, resume: bool, restart: bool, splits: list[int],
             device: torch.device) -> Calibration | None:
    """The partial file's statistics when this run continues it (None: it starts from zero)."""
    refused = partial_refusal(partial, resume, restart)
    if refused:
        raise RidgefillError(refused)
    if restart:
        partial.unlink(missing_ok=True)
    if restart or not (resume and partial.exists()):
        return None
    tensors, saved = load_artifact(partial, "stats")
    if "code" in run_meta and saved.get("code") != run_meta["code"]:
        raise RidgefillError(f"{partial} was written by other ridgefill code (source {saved.get('code')}, now "
                             f"{run_meta['code']}): sums from other code cannot be continued; pass --restart to start "
                             "over")
    changed = [k for k in run_meta if k not in NAMES and saved.get(k) != run_meta[k]]
    if changed:
        k = changed[0]
        raise RidgefillError(f"{partial} was written with other settings ({k} {saved.get(k)!r}, now {run_meta[k]!r}): "
                             "pass --restart to start over")
    return Calibration.from_tensors(splits, tensors, saved, device)


def _check_same_settings(world: World, run_meta: dict) -> None:
    """Every process must calibrate the same model on the same data with the same settings as rank 0."""
    ours = {k: v for k, v in run_meta.items() if k not in NAMES}
    theirs = world.from_root(ours)
    changed = [k for k in ours if theirs.get(k) != ours[k]]
    if changed:
        raise RidgefillError(f"rank {world.rank} has another {changed[0]} than rank 0: give every process the same "
                             "model, data and options")


def _checkpoint(cal: Calibration, world: World, done: int, path: Path, meta: dict, final: bool = False) -> None:
    """Sum every process's statistics into rank 0's and write them there: global sums, `done` global sequences
    (the final file also records its token count as `tokens`)."""
    if world.size > 1:
        cal.reduce(world.reduce_sum, world.root)
    cal.sequences_done = done
    if world.root:
        counts = {"sequences_done": done, "tokens_done": cal.tokens_done}
        save_artifact(path, cal.tensors(), {**meta, **counts, **({"tokens": cal.tokens_done} if final else {})})


def _rounds(sequences: Iterable, size: int) -> Iterator[tuple[list, bool]]:
    """Blocks of `size` consecutive sequences (the last may be shorter), each with whether it is the last."""
    stream = iter(sequences)
    block = list(islice(stream, size))
    while block:
        after = list(islice(stream, size))
        yield block, not after
        block = after


# --- the pass -------------------------------------------------------------------------------------------------
def run_calibration(runner: Runner, sequences: Iterable[list[int]], splits: list[int], out, meta: dict,
                    holdout: float = 0.1, skip_first: int = 1, outlier_factor: float = OUTLIER_FACTOR,
                    checkpoint_every: int = 0, checkpoint_seconds: float = 0.0, resume: bool = False,
                    restart: bool = False, advance=lambda n=1: None, chunk: int | None = None,
                    world: World = World(), normalized: bool = False, lookback: int = 0,
                    window=None) -> Calibration:
    """Accumulate statistics over the stream `sequences` (every process sees the same stream and takes its share),
    checkpointing to `<out>.partial` and resuming from it. Returns rank 0's global statistics (on other ranks:
    their zeroed share). normalized: also the normalised targets' sums (`SplitStats`); lookback: the maps' inputs
    also hold the split states of the K rows before each row (torchfill/lookback.py); window (torchfill.FilledWindow):
    the rows past the sinks attend locally below the split, as filled rows will (stored as `filled_window`)."""
    partial = partial_path(out)
    run_meta = {**meta, "artifact": "stats", "splits": sorted(splits), "holdout": holdout,
                "skip_first": skip_first, "outlier_factor": outlier_factor, "n_layers": runner.n_layers,
                "hidden_size": runner.shape.hidden, **({"normalized_targets": True} if normalized else {}),
                **({"lookback": lookback} if lookback else {}),
                **({"filled_window": window.to_meta()} if window is not None else {})}
    cal = start_calibration(runner, splits, partial, run_meta, resume, restart, world, normalized, lookback)
    done = cal.sequences_done
    if done:
        advance(done)
    every = heldout_every(holdout)
    clock = Checkpoints(checkpoint_every, checkpoint_seconds, done)
    for block, last in _rounds(islice(sequences, done, None), world.size):
        if world.rank < len(block):
            ids = torch.tensor([block[world.rank]], device=runner.device)  # [1, T]
            accumulate(runner, cal, ids, part_of(done + world.rank, every), skip_first, outlier_factor, chunk, window)
        done += len(block)
        advance(len(block))
        if not last and world.from_root(clock.due(done)):
            _checkpoint(cal, world, done, partial, run_meta)
            clock.mark(done)
    _checkpoint(cal, world, done, Path(out), run_meta, final=True)
    if world.root:
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
    restart: bool = option(False, "Discard <out>.partial and start over (a plain rerun refuses to overwrite it).",
                           role="restart", keyed=False)
    holdout: float = option(0.1, "Share of sequences held out (0..0.5), alternately validation and test.")
    skip_first: int = option(1, "Leading rows of each sequence kept out (sinks).")
    outlier_factor: float = option(OUTLIER_FACTOR, "Drop rows whose split-state norm exceeds this x the sequence "
                                   "median; 0 keeps all.")
    checkpoint_seconds: float = option(600.0, "Seconds between checkpoints to <out>.partial (0: no time rule).",
                                       keyed=False)
    checkpoint_every: int = option(0, "Also checkpoint every this many sequences (0: off).", keyed=False)
    normalized_targets: bool = option(False, "Also accumulate the sums of per-row normalised targets y/rms(y), for "
                                      "`fit --targets normalized` (twice the XᵀY memory and file size).")
    lookback: int = option(0, "Maps also read the split states of the K rows before each row (0: x alone); "
                           "(K+1)² times the XᵀX and K+1 times the XᵀY memory and file size.")
    filled_window: int = option(0, "Calibrate on split states whose rows past --skip-first attend only to those "
                                "sinks and the W rows before them below the split, as filled rows with "
                                "--filled-window W will (0: full attention); the maps carry it.")
    filled_window_layers: str | None = option(None, "Layers 'a-b' that window with --filled-window (default: every "
                                              "layer below the lowest split).")
    nproc: int = option(1, "Processes sharing the sequences: > 1 re-launches this command under "
                        "torch.distributed.run on this machine (under torchrun, its processes are used).", keyed=False)

    def check(self) -> None:
        if self.tokens < 1 or self.seq_len < 2:
            raise RidgefillError("--tokens must be >= 1 and --seq-len >= 2")
        if not 0 <= self.holdout <= 0.5:
            raise RidgefillError(f"--holdout {self.holdout} is out of range: use a share between 0 and 0.5")
        if self.checkpoint_seconds < 0 or self.checkpoint_every < 0:
            raise RidgefillError("--checkpoint-seconds and --checkpoint-every must be >= 0 (0: that rule off)")
        if self.nproc < 1:
            raise RidgefillError(f"--nproc must be at least 1, got {self.nproc}")
        if self.lookback < 0:
            raise RidgefillError(f"--lookback must be 0 (x alone) or more, got {self.lookback}")
        if self.skip_first + self.lookback >= self.seq_len:
            raise RidgefillError(f"--skip-first {self.skip_first} and --lookback {self.lookback} leave no row of a "
                                 f"{self.seq_len}-token sequence to fit on: lower them or raise --seq-len")
        check_window_values(self.filled_window, self.filled_window_layers)
        if self.skip_first < 0 or self.outlier_factor < 0:
            raise RidgefillError(f"--skip-first ({self.skip_first}) and --outlier-factor ({self.outlier_factor:g}) "
                                 "must be 0 or more (0: keep every row)")
        check_output(self, beside=(".json", ".partial"))


def run(c: CalibrateConfig) -> dict:
    """Calibrate (in this process, or in --nproc processes), print the row counts per split and write the
    statistics with a JSON summary beside them (rank 0 only)."""
    check_device(c.device, c.dtype)  # resolved as the config was built; the processes relaunched get it resolved
    if c.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch(c, "calibrate", c.nproc, Path(str(c.out) + ".json"))
    with joined_world(c.device) as world:  # every rank exits 0: a barrier, then the group shut down
        return _calibrate(c, world)


def _calibrate(c: CalibrateConfig, world: World) -> dict:
    refused = world.from_root(partial_refusal(partial_path(c.out), c.resume, c.restart) if world.root else None)
    if refused:  # before the model loads
        raise RidgefillError(refused if world.root else f"rank 0 cannot start: {refused}")
    session = c.open()
    n_layers = session.runner.n_layers
    splits = parse_splits(c.split, n_layers)
    check_fittable(splits, n_layers)
    window = calibration_window(c.filled_window, c.filled_window_layers, splits, c.skip_first)
    corpus, documents, sequences = calibration_sequences(session, c.data, c.seq_len, c.tokens)
    meta = {"model": {"id": c.model, "weights_hash": session.loaded.fingerprint}, "data": corpus.name,
            "data_hash": documents_hash(documents), "tokens_requested": c.tokens, "seq_len": c.seq_len,
            "dtype": c.dtype, "code": code_hash()}
    budget = sequence_budget(c.tokens, c.seq_len)  # an upper bound: the text may run out first
    started = time.perf_counter()
    bar = progress_bar(f"calibrating splits {','.join(map(str, splits))}", budget) if world.root else \
        nullcontext(lambda n=1: None)
    with bar as advance:
        cal = run_calibration(session.runner, sequences, splits, c.out, meta, c.holdout, c.skip_first,
                              c.outlier_factor, c.checkpoint_every, c.checkpoint_seconds, c.resume, c.restart,
                              advance, world=world, normalized=c.normalized_targets, lookback=c.lookback,
                              window=window)
    if not world.root:
        return {"command": "calibrate", "rank": world.rank}
    if cal.sequences_done < budget:
        note(f"note: the data gave {cal.sequences_done} sequences of {c.seq_len} tokens, fewer than the {budget} "
             f"that --tokens {c.tokens} asks for")
    return _report(c, cal, world, time.perf_counter() - started)


def calibration_window(size: int, layers: str | None, splits: list[int], sinks: int):
    """The window calibration's rows attend in (torchfill.FilledWindow, None: full attention): layers `layers`
    (default every layer below the lowest split, which every split's maps then share), the first `sinks` rows
    (--skip-first) as sinks."""
    return resolve_window(size, layers, min(splits), sinks, None)


def calibration_sequences(session, data: str, seq_len: int, tokens: int):
    """(corpus, its calibration documents, the stream of `seq_len`-token sequences up to `tokens` tokens) for a
    session's model; refuses a --seq-len past the model's context and text that yields no sequence, before any
    sequence runs."""
    check_length("--seq-len", seq_len, session.context_length)
    corpus = load_corpus(data)
    documents = documents_for(corpus, "calibration")
    stream = iter_sequences(session.tokenizer, documents, seq_len, tokens)
    first = next(stream, None)
    if first is None:
        raise RidgefillError(f"data '{data}' yields no calibration sequence of {seq_len} tokens: give more text or "
                             "a smaller --seq-len")
    return corpus, documents, chain([first], stream)


SKIPPED = ("skipped_first", "skipped_outliers", "skipped_nonfinite")  # the counts of rows kept out (statistics.py)
ROW_NAMES = ["split", "train_rows", "val_rows", "test_rows", *SKIPPED]


def _report(c: CalibrateConfig, cal: Calibration, world: World, duration_s: float) -> dict:
    """The table of row counts per split, and the JSON summary beside the statistics."""
    rows = []
    for s in cal.splits:
        parts = [cal.stats[(s, p)] for p in ("train", *HELD_OUT)]
        rows.append([s, *(st.count for st in parts), *(sum(getattr(st, n) for st in parts) for n in SKIPPED)])
    table(f"calibration statistics → {c.out}", ["split", "train rows", "val rows", "test rows", "sink rows skipped",
                                                 "outlier rows skipped", "non-finite rows skipped"], rows)
    worst = max(rows, key=lambda r: r[-1])
    if worst[-1]:
        fix = ": calibrating with --dtype fp32 avoids the overflow" if c.dtype != "fp32" else ""
        note(f"note: {worst[-1]} rows of split {worst[0]} held a NaN or an infinity in a hidden state and were kept "
             f"out of the statistics{fix}")
    summary = {"command": "calibrate", **cal.meta, "tokens": cal.tokens_done, "sequences": cal.sequences_done,
               "processes": world.size, "ridgefill_version": __version__, "duration_s": duration_s,
               "rows": [dict(zip(ROW_NAMES, r)) for r in rows]}
    write_json(Path(str(c.out) + ".json"), summary)
    return summary


COMMAND = Command("calibrate", CalibrateConfig, run, writes=".safetensors", summary_json=True, makes="stats")
