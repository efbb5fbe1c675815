"""Bad input to every command, through the real console entry point (`ridgefill.cli.main`): each case must end
with exit code 2 and exactly one line on stderr, `error: ...` (no traceback), that line saying the case's own problem
in the words its `match` gives (required: a refusal for another, earlier reason fails the case), and leave nothing
behind: the --out folder holds what it held before (no result, no temporary file beside it) and the working folder
stays empty.

Cases run in-process (sys.argv patched, SystemExit caught; stderr captured at the file-descriptor level); a few
run again in a subprocess (`python -m ridgefill`) to prove the same end to end. Inputs are tiny: two tiny
checkpoints that differ only in their random init (A and B), statistics and maps calibrated and fitted once on
A (tokens 1024, seq-len 128).

A case's arguments, text files and match may name the fixtures as {A}, {B}, {stats}, {maps}, {text} (calibration
text), {docs} (long .jsonl documents), {lb} (LongBench records), {in} (the case's own input folder, holding its
files) and {out} (the folder its outputs would go to).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from fixtures.longbench_fixture import build_records, write_jsonl
from helpers import run_main
from tiny_checkpoint import save_tiny_checkpoint, training_text, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


# --- fixtures -----------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    A: Path  # a tiny checkpoint
    B: Path  # the same architecture and tokenizer, other weights (another random init)
    stats: Path  # calibrated on A, splits 2 and 3
    maps: Path  # fitted on A, split 3
    text: Path  # calibration text
    docs: Path  # .jsonl of long documents (evaluation passages of 256 tokens)
    lb: Path  # LongBench v2 records
    result: Path  # a loss result document of A

    def names(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self).items()}


@pytest.fixture(scope="module")
def inputs(tiny_checkpoint, tmp_path_factory) -> Inputs:
    from ridgefill.commands import command

    root = tmp_path_factory.mktemp("bad-input")
    other = save_tiny_checkpoint(root / "B", seed=1)
    text = write_corpus(root / "text.txt", seed=3, lines_per_document=12)
    docs = root / "docs.jsonl"
    lines = training_text(1200, seed=5)
    documents = [" ".join(lines[i:i + 48]) for i in range(0, len(lines), 48)]
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    lb = write_jsonl(root / "lb.jsonl", build_records(documents, 4, 60))
    stats, maps = root / "stats.safetensors", root / "maps.safetensors"
    command("calibrate")(model=str(tiny_checkpoint), data=str(text), split="2,3", tokens=1024, seq_len=128,
                         holdout=0.25, out=stats)
    command("fit")(stats=stats, split=3, out=maps)
    result = root / "loss.json"
    command("loss")(model=str(tiny_checkpoint), maps=maps, data=str(docs), context=256, short=64, samples=1,
                    tail=16, out=result)
    return Inputs(tiny_checkpoint, other, stats, maps, text, docs, lb, result)


# --- bad files ----------------------------------------------------------------------------------------------
EMPTY = b""
BINARY = bytes(random.Random(0).randrange(256) for _ in range(4096)) + b"\x00" * 64  # not text: NULs, invalid UTF-8
NESTED = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # JSON nested past Python's recursion limit
LATIN1 = ("Café, déjà vu et naïveté. " * 200).encode("latin-1")  # text, but not UTF-8
LATIN1_JSONL = ('{"text": "' + "Café, déjà vu et naïveté. " * 40 + '"}\n').encode("latin-1")
NOT_AN_OBJECT = b'["a list", "not an object"]\n'
NOT_JSON = b'{"text": "an unterminated record"\n'


def cut(artifact: str, where: str) -> Callable[[Inputs], bytes]:
    """The bytes of a fixture artifact (stats or maps) truncated: to 4 bytes, in the middle of its JSON header, in
    the middle of its tensor data, or just its last byte missing."""

    def truncated(found: Inputs) -> bytes:
        data = getattr(found, artifact).read_bytes()
        header = 8 + struct.unpack("<Q", data[:8])[0]
        end = {"4": 4, "header": header // 2, "data": header + (len(data) - header) // 2, "last": len(data) - 1}
        return data[:end[where]]

    return truncated


def copy_of(artifact: str) -> Callable[[Inputs], bytes]:
    return lambda found: getattr(found, artifact).read_bytes()


def result_with(**changes) -> Callable[[Inputs], bytes]:
    """The fixture's loss result document with some keys replaced (None: removed)."""

    def changed(found: Inputs) -> bytes:
        doc = json.loads(found.result.read_text())
        for key, value in changes.items():
            if value is None:
                doc.pop(key, None)
            else:
                doc[key] = value
        return json.dumps(doc).encode()

    return changed


def rewritten(artifact: str, edit: Callable[[dict, dict], None]) -> Callable[[Inputs], bytes]:
    """The bytes of a fixture artifact (stats or maps) after `edit(tensors, meta)` changed its tensors and its
    ridgefill metadata in place, written with safetensors itself: ridgefill's writer would refuse what some cases
    hold (a NaN, say), and a damaged file does not come from it anyway."""

    def changed(found: Inputs) -> bytes:
        from safetensors import safe_open
        from safetensors.torch import save

        with safe_open(str(getattr(found, artifact)), framework="pt") as f:
            metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(metadata["ridgefill"])
        edit(tensors, meta)
        tensors = {k: t.contiguous() for k, t in tensors.items()}
        return save(tensors, metadata={**metadata, "ridgefill": json.dumps(meta)})

    return changed


def maps_with(**changes) -> Callable[[Inputs], bytes]:
    """The fixture's maps file with some keys of its ridgefill metadata replaced (its tensors and model the same)."""
    return rewritten("maps", lambda tensors, meta: meta.update(changes))


def changed_tensor(artifact: str, name: str, change: Callable) -> Callable[[Inputs], bytes]:
    """A fixture artifact (stats or maps) with tensor `name` changed by `change` (on a copy; a change that returns
    None removes it)."""

    def edit(tensors: dict, meta: dict) -> None:
        tensors[name] = change(tensors[name].clone())
        if tensors[name] is None:  # the change removes the tensor
            del tensors[name]

    return rewritten(artifact, edit)


def partial_of_this_code() -> Callable[[Inputs], bytes]:
    """The fixture's statistics as a calibration checkpoint of this ridgefill's source (as a run now would write it):
    a resume from it is refused only for what its case changes."""

    def edit(tensors: dict, meta: dict) -> None:
        from ridgefill.runtime.provenance import code_hash

        meta["code"] = code_hash()

    return rewritten("stats", edit)


def first_set(value: float) -> Callable:
    """A change of a tensor: its first value set to `value`."""

    def change(t):
        t.view(-1)[0] = value
        return t

    return change


def model_folder(**files) -> dict:
    """A model folder `{in}/model`: a copy of checkpoint A with `files` (config_json: config.json) replaced (None:
    removed)."""
    out = {"model": COPY_OF_A}
    out.update({"model/{}.{}".format(*name.rsplit("_", 1)): content for name, content in files.items()})
    return out


COPY_OF_A = object()  # the content of a folder entry: a copy of checkpoint A


def without(artifact: str, *, tensor: str | None = None, meta_key: str | None = None) -> Callable[[Inputs], bytes]:
    """The bytes of a fixture artifact with one tensor, or one key of its ridgefill metadata, left out."""
    return rewritten(artifact, lambda tensors, meta: (tensors.pop(tensor, None), meta.pop(meta_key, None)))


def with_key_scale(heads: int) -> Callable[[Inputs], bytes]:
    """The fixture's maps with a key scale of `heads` values per layer (checkpoint A has 2 KV heads)."""

    def edit(tensors: dict, meta: dict) -> None:
        import torch

        tensors["key_scale"] = torch.ones(meta["n_layers"] - meta["split"], heads)

    return rewritten("maps", edit)


def serving(variant: str = "ridge", maps: str | None = "{maps}", sha256: str | None = None, **fields):
    """A serving config for checkpoint A as `ridgefill tune` writes it (the maps by path and sha256)."""

    def written(found: Inputs) -> bytes:
        from ridgefill.method.fill import SERVING_KIND
        from ridgefill.runtime.models import checkpoint_fingerprint
        from ridgefill.runtime.paths import file_sha256

        path = None if maps is None else maps.format(**found.names())
        doc = {"kind": SERVING_KIND, "version": 2, "model": {"weights_hash": checkpoint_fingerprint(found.A)},
               "variant": variant, "split": 3, "tail": 8, "keep_first": 1, "outlier_factor": 20.0,
               "maps": None if path is None else {"path": path, "sha256": sha256 or file_sha256(path)}, **fields}
        return json.dumps(doc).encode()

    return written


TUNE = ["tune", "--model", "{A}", "--data", "{text}", "--splits", "3-4", "--tail", "32", "--tokens", "1024",
        "--seq-len", "128", "--lengths", "320", "--tasks", "niah_single_1", "--samples", "1", "--no-nll-check",
        "--out-dir", "{out}/tune"]
LM_EVAL = ["lm-eval", "--model", "ridgefill", "--tasks", "arc_easy", "--limit", "1", "--model_args"]


RECIPE = """name = "bad"
model = "{A}"
data = "{text}"
splits = 3
tails = 16

[calibrate]
tokens = 1024
seq-len = 128

[fit]
"""


# --- cases --------------------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    args: list[str]
    files: dict = field(default_factory=dict)  # name under {in} (or out/NAME: under {out}) -> content
    # the words of the error line that name this case's problem (case-insensitive; it may name the fixtures and
    # folders as the arguments do): required, and more than an option's name, which several refusals repeat
    match: str = field(kw_only=True)

    def __post_init__(self):
        if len(self.match.split()) < MATCH_WORDS:
            raise ValueError(f"case {self.id}: match {self.match!r} is too short to tell its refusal from another: "
                             f"give the words of the error that name the problem (at least {MATCH_WORDS})")

    def param(self):
        return pytest.param(self, id=self.id)


MATCH_WORDS = 3


def cmd(base: list[str], *flags: str, **options) -> list[str]:
    """`base` with options replaced (`None`: removed) or added, and boolean flags appended."""
    args = list(base)
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if flag in args:
            i = args.index(flag)
            if value is None:
                del args[i:i + 2]
            else:
                args[i + 1] = str(value)
        elif value is not None:
            args += [flag, str(value)]
    return args + list(flags)


PROMPT = "The grass is green. The sky is blue. One of the special magic numbers for king is: 1234567. " * 3
CAL = ["calibrate", "--model", "{A}", "--data", "{text}", "--split", "2", "--tokens", "1024", "--seq-len", "128",
       "--out", "{out}/stats.safetensors"]
FIT = ["fit", "--stats", "{stats}", "--split", "3", "--out", "{out}/maps.safetensors"]
GEN = ["generate", "--model", "{A}", "--maps", "{maps}", "--prompt", PROMPT, "--tail", "8", "--max-new-tokens", "4"]
RULER = ["ruler", "--model", "{A}", "--maps", "{maps}", "--lengths", "256", "--tasks", "niah_single_1", "--samples",
         "1", "--tail", "16", "--haystack", "noise", "--max-new-tokens", "4", "--out", "{out}/ruler.json"]
LOSS = ["loss", "--model", "{A}", "--maps", "{maps}", "--data", "{docs}", "--context", "256", "--short", "64",
        "--samples", "1", "--tail", "16", "--out", "{out}/loss.json"]
SPLICE = ["splice", "--model", "{A}", "--maps", "{maps}", "--data", "{docs}", "--context", "256", "--short", "64",
          "--samples", "1", "--tail", "16", "--swap", "keys", "--out", "{out}/splice.json"]
LB = ["longbench", "--model", "{A}", "--maps", "{maps}", "--data", "{lb}", "--limit", "1", "--tail", "16",
      "--max-len", "400", "--out", "{out}/longbench.json"]
SERVE = ["serve", "--model", "{A}", "--maps", "{maps}", "--tail", "16", "--port", "18000", "--max-model-len", "256"]
TTFT = ["bench-ttft", "--model", "{A}", "--maps", "{maps}", "--lengths", "32", "--repeats", "1", "--warmup", "0",
        "--data", "random", "--tail", "8", "--out", "{out}/ttft.json"]
KS = ["key-scale", "--model", "{A}", "--maps", "{maps}", "--data", "{text}", "--tokens", "256", "--seq-len", "128",
      "--out", "{out}/maps-ks.safetensors"]
RUN = ["run", "{in}/recipe.toml", "--out-dir", "{out}/run"]
REPORT = ["report", "{in}/results"]
BASES = {"calibrate": CAL, "fit": FIT, "generate": GEN, "ruler": RULER, "loss": LOSS, "splice": SPLICE,
         "longbench": LB, "bench-ttft": TTFT, "key-scale": KS}

def data_cases(name: str, base: list[str], empty: str) -> list[Case]:
    """--data of the text commands (calibrate, key-scale, loss, splice): missing, a folder of no text, empty (`empty`:
    the command's message for it), binary, not UTF-8, a JSONL line that is no object or no JSON."""
    c = name
    return [
        Case(f"{c}-data-missing", cmd(base, data="{in}/missing.txt"), match="unknown data '{in}/missing.txt'"),
        Case(f"{c}-data-folder-without-text", cmd(base, data="{in}/folder"), {"folder/notes.md": b"# no text"},
             match="{in}/folder holds no .txt or .jsonl files"),
        Case(f"{c}-data-empty", cmd(base, data="{in}/empty.txt"), {"empty.txt": EMPTY}, match=empty),
        Case(f"{c}-data-binary", cmd(base, data="{in}/binary.txt"), {"binary.txt": BINARY},
             match="--data {in}/binary.txt is not UTF-8 text"),
        Case(f"{c}-data-jsonl-binary", cmd(base, data="{in}/binary.jsonl"), {"binary.jsonl": BINARY},
             match="--data {in}/binary.jsonl is not UTF-8 text"),
        Case(f"{c}-data-jsonl-not-utf8", cmd(base, data="{in}/latin1.jsonl"), {"latin1.jsonl": LATIN1_JSONL},
             match="--data {in}/latin1.jsonl is not UTF-8 text"),
        Case(f"{c}-data-jsonl-line-not-object", cmd(base, data="{in}/list.jsonl"), {"list.jsonl": NOT_AN_OBJECT},
             match="{in}/list.jsonl:1: record has no string field 'text'"),
        Case(f"{c}-data-jsonl-line-not-json", cmd(base, data="{in}/bad.jsonl"), {"bad.jsonl": NOT_JSON},
             match="{in}/bad.jsonl:1: not valid JSON"),
    ]


CALIBRATION_DATA_EMPTY = "data '{in}/empty.txt' yields no calibration sequence of 128 tokens"
EVALUATION_DATA_EMPTY = "data '{in}/empty.txt' has no evaluation passage of 256 tokens"
STATS_CORRUPT = "cannot read stats file {in}/s.safetensors: it is corrupted or truncated"
MAPS_CORRUPT = "cannot read maps file {in}/m.safetensors: it is corrupted or truncated"


def maps_cases(name: str, base: list[str]) -> list[Case]:
    """--maps of the commands that fill: from another model, a stats file, truncated, empty, binary, missing, a
    folder."""
    c = name
    return [
        Case(f"{c}-maps-other-model", cmd(base, model="{B}"), match="{maps} was fitted for another model"),
        Case(f"{c}-maps-is-stats", cmd(base, maps="{stats}"),
             match="{stats} is not a ridgefill maps file (found: stats)"),
        Case(f"{c}-maps-truncated-4-bytes", cmd(base, maps="{in}/m.safetensors"), {"m.safetensors": cut("maps", "4")},
             match=MAPS_CORRUPT),
        Case(f"{c}-maps-truncated-mid-header", cmd(base, maps="{in}/m.safetensors"),
             {"m.safetensors": cut("maps", "header")}, match=MAPS_CORRUPT),
        Case(f"{c}-maps-truncated-mid-data", cmd(base, maps="{in}/m.safetensors"),
             {"m.safetensors": cut("maps", "data")}, match=MAPS_CORRUPT),
        Case(f"{c}-maps-empty", cmd(base, maps="{in}/m.safetensors"), {"m.safetensors": EMPTY}, match=MAPS_CORRUPT),
        Case(f"{c}-maps-binary", cmd(base, maps="{in}/m.safetensors"), {"m.safetensors": BINARY}, match=MAPS_CORRUPT),
        Case(f"{c}-maps-missing", cmd(base, maps="{in}/missing.safetensors"),
             match="maps file {in}/missing.safetensors does not exist"),
        Case(f"{c}-maps-folder", cmd(base, maps="{in}/folder"), {"folder/x.txt": b"x"},
             match="maps file {in}/folder is a folder, not a file"),
    ]


CASES: list[Case] = [
    # --- calibrate ---
    *data_cases("calibrate", CAL, CALIBRATION_DATA_EMPTY),
    Case("calibrate-data-not-utf8-text", cmd(CAL, data="{in}/latin1.txt"), {"latin1.txt": LATIN1},
         match="--data {in}/latin1.txt is not UTF-8 text"),
    Case("calibrate-seq-len-past-context", cmd(CAL, seq_len=5000, tokens=5000),
         match="--seq-len 5000 exceeds the model's context of 4096 tokens"),
    Case("calibrate-tokens-zero", cmd(CAL, tokens=0), match="--tokens must be >= 1 and --seq-len >= 2"),
    Case("calibrate-tokens-negative", cmd(CAL, tokens=-128), match="--tokens must be >= 1 and --seq-len >= 2"),
    Case("calibrate-seq-len-one", cmd(CAL, seq_len=1), match="--tokens must be >= 1 and --seq-len >= 2"),
    Case("calibrate-split-zero", cmd(CAL, split=0), match="split [0] is out of range: use 1..5"),
    Case("calibrate-split-last-layer", cmd(CAL, split=6), match="split [6] is out of range: use 1..5"),
    Case("calibrate-split-not-a-number", cmd(CAL, split="two"),
         match="--split 'two' is not a comma-separated list of integers"),
    Case("calibrate-holdout-out-of-range", cmd(CAL, holdout=0.9), match="--holdout 0.9 is out of range"),
    Case("calibrate-chunk-zero", cmd(CAL, chunk=0), match="--chunk must be at least 1, got 0"),
    Case("calibrate-chunk-negative", cmd(CAL, chunk=-4), match="--chunk must be at least 1, got -4"),
    Case("calibrate-skip-first-negative", cmd(CAL, skip_first=-1),
         match="--skip-first (-1) and --outlier-factor (20) must be 0 or more"),
    Case("calibrate-lookback-negative", cmd(CAL, lookback=-1), match="--lookback must be 0 (x alone) or more, got -1"),
    Case("calibrate-lookback-whole-sequence", cmd(CAL, lookback=127),
         match="--lookback 127 leave no row of a 128-token sequence"),
    Case("calibrate-outlier-factor-negative", cmd(CAL, outlier_factor=-1),
         match="--outlier-factor (-1) must be 0 or more"),
    Case("calibrate-checkpoint-every-negative", cmd(CAL, checkpoint_every=-1),
         match="--checkpoint-seconds and --checkpoint-every must be >= 0"),
    Case("calibrate-unknown-dtype", cmd(CAL, dtype="fp8"), match="unknown dtype 'fp8': use auto, fp32, bf16, fp16"),
    Case("calibrate-unknown-device", cmd(CAL, device="tpu"), match="unknown device 'tpu': use auto, cpu or cuda"),
    Case("calibrate-device-auto-spelled-otherwise", cmd(CAL, device="AUTO"),
         match="unknown device 'AUTO': use auto, cpu or cuda"),
    Case("calibrate-model-missing", cmd(CAL, model="{in}/no-model"), match="unknown model '{in}/no-model'"),
    Case("calibrate-model-is-a-file", cmd(CAL, model="{in}/config.json"), {"config.json": b"{}"},
         match="unknown model '{in}/config.json'"),
    Case("calibrate-model-config-empty", cmd(CAL, model="{in}/model"), model_folder(config_json=EMPTY),
         match="cannot read the config.json of model {in}/model"),
    Case("calibrate-model-config-binary", cmd(CAL, model="{in}/model"), model_folder(config_json=BINARY),
         match="cannot read the config.json of model {in}/model"),
    Case("calibrate-model-config-nested", cmd(CAL, model="{in}/model"), model_folder(config_json=NESTED),
         match="cannot read the config.json of model {in}/model (RecursionError"),
    Case("calibrate-model-without-weights", cmd(CAL, model="{in}/model"), model_folder(model_safetensors=None),
         match="cannot load the weights of model {in}/model"),
    Case("calibrate-model-weights-truncated", cmd(CAL, model="{in}/model"),
         model_folder(model_safetensors=lambda found: (found.A / "model.safetensors").read_bytes()[:5000]),
         match="cannot load the weights of model {in}/model"),
    Case("calibrate-resume-from-other-model", cmd(CAL, "--resume", model="{B}", split="2,3", holdout=0.25),
         {"out/stats.safetensors.partial": partial_of_this_code()},
         match="{out}/stats.safetensors.partial was written with other settings (model"),
    Case("calibrate-resume-from-truncated-checkpoint", cmd(CAL, "--resume"),
         {"out/stats.safetensors.partial": cut("stats", "data")},
         match="cannot read stats file {out}/stats.safetensors.partial: it is corrupted or truncated"),

    # --- fit ---
    Case("fit-stats-missing", cmd(FIT, stats="{in}/missing.safetensors"),
         match="stats file {in}/missing.safetensors does not exist"),
    Case("fit-stats-folder", cmd(FIT, stats="{in}/folder"), {"folder/x.txt": b"x"},
         match="stats file {in}/folder is a folder, not a file"),
    Case("fit-stats-empty", cmd(FIT, stats="{in}/s.safetensors"), {"s.safetensors": EMPTY}, match=STATS_CORRUPT),
    Case("fit-stats-binary", cmd(FIT, stats="{in}/s.safetensors"), {"s.safetensors": BINARY}, match=STATS_CORRUPT),
    *[Case(f"fit-stats-truncated-{where}", cmd(FIT, stats="{in}/s.safetensors"),
           {"s.safetensors": cut("stats", where)}, match=STATS_CORRUPT)
      for where in ("4", "header", "data", "last")],
    Case("fit-stats-is-maps", cmd(FIT, stats="{maps}"), match="{maps} is not a ridgefill stats file (found: maps)"),
    Case("fit-stats-is-a-model", cmd(FIT, stats="{A}/model.safetensors"),
         match="{A}/model.safetensors is not a ridgefill stats file (found: no ridgefill metadata)"),
    Case("fit-split-not-in-stats", cmd(FIT, split=4), match="{stats} has no statistics for split 4"),
    Case("fit-rank-zero", cmd(FIT, rank=0), match="--rank 0 is out of range: use 1..63"),
    Case("fit-rank-negative", cmd(FIT, rank=-2), match="--rank -2 is out of range: use 1..63"),
    Case("fit-rank-hidden-size", cmd(FIT, rank=64), match="--rank 64 is out of range: use 1..63"),
    Case("fit-lam-zero", cmd(FIT, lam=0), match="--lam must be positive, got 0"),
    Case("fit-lam-negative", cmd(FIT, lam=-1), match="--lam must be positive, got -1"),
    Case("fit-lam-not-a-number", cmd(FIT, lam="big"), match="--lam 'big' is neither 'auto' nor a number"),
    Case("fit-unknown-kind", cmd(FIT, kind="lasso"), match="unknown --kind 'lasso'"),
    Case("fit-unknown-targets", cmd(FIT, targets="unit"), match="unknown --targets 'unit'"),
    Case("fit-unknown-rank-basis", cmd(FIT, rank=4, rank_basis="svd"),
         match="unknown --rank-basis 'svd': use inputs or weights"),
    Case("fit-normalized-without-their-statistics", cmd(FIT, targets="normalized"),
         match="{stats} has no normalised-target statistics"),

    # --- key-scale ---
    *data_cases("key-scale", KS, CALIBRATION_DATA_EMPTY),
    *maps_cases("key-scale", KS),
    Case("key-scale-tokens-zero", cmd(KS, tokens=0), match="--tokens must be >= 1 and --seq-len >= 2"),
    Case("key-scale-unknown-device", cmd(KS, device="mps"), match="unknown device 'mps': use auto, cpu or cuda"),
    Case("key-scale-skip-first-whole-sequence", cmd(KS, skip_first=127),
         match="--skip-first 127 leaves no row of a 128-token sequence"),
    Case("key-scale-skip-first-negative", cmd(KS, skip_first=-1), match="--skip-first -1 must be 0 or more"),
    Case("key-scale-seq-len-past-context", cmd(KS, seq_len=100000),
         match="--seq-len 100000 exceeds the model's context of 4096 tokens"),

    # --- generate ---
    *maps_cases("generate", GEN),
    Case("generate-prompt-file-empty", cmd(GEN, prompt=None, prompt_file="{in}/p.txt"), {"p.txt": EMPTY},
         match="the prompt is empty after tokenization"),
    Case("generate-prompt-file-binary", cmd(GEN, prompt=None, prompt_file="{in}/p.txt"), {"p.txt": BINARY},
         match="--prompt-file {in}/p.txt is not UTF-8 text"),
    Case("generate-prompt-file-not-utf8", cmd(GEN, prompt=None, prompt_file="{in}/p.txt"), {"p.txt": LATIN1},
         match="--prompt-file {in}/p.txt is not UTF-8 text"),
    Case("generate-prompt-file-missing", cmd(GEN, prompt=None, prompt_file="{in}/missing.txt"),
         match="--prompt-file {in}/missing.txt does not exist"),
    Case("generate-prompt-file-folder", cmd(GEN, prompt=None, prompt_file="{in}/folder"), {"folder/x.txt": b"x"},
         match="--prompt-file {in}/folder is not a file"),
    Case("generate-prompt-and-prompt-file", cmd(GEN, prompt_file="{in}/p.txt"), {"p.txt": b"hello"},
         match="give exactly one of --prompt or --prompt-file"),
    Case("generate-prompt-plus-new-tokens-past-context", cmd(GEN, max_new_tokens=4090),
         match="plus 4090 new tokens exceed the model's context of 4096"),
    Case("generate-max-new-tokens-zero", cmd(GEN, max_new_tokens=0), match="--max-new-tokens must be at least 1"),
    Case("generate-max-new-tokens-negative", cmd(GEN, max_new_tokens=-3), match="--max-new-tokens must be at least 1"),
    Case("generate-tail-zero", cmd(GEN, tail=0), match="--tail 0 must be an integer of at least 1"),
    Case("generate-tail-negative", cmd(GEN, tail=-1), match="--tail -1 must be an integer of at least 1"),
    Case("generate-keep-first-negative", cmd(GEN, keep_first=-1),
         match="--keep-first -1 must be an integer of at least 0"),
    Case("generate-split-not-the-maps", cmd(GEN, split=2), match="{maps} holds maps for split 3, not 2"),
    Case("generate-chunk-zero", cmd(GEN, chunk=0), match="--chunk must be at least 1, got 0"),
    Case("generate-unknown-device", cmd(GEN, device="gpu"), match="unknown device 'gpu': use auto, cpu or cuda"),
    Case("generate-unknown-dtype", cmd(GEN, dtype="float32"),
         match="unknown dtype 'float32': use auto, fp32, bf16, fp16"),

    # --- ruler ---
    *maps_cases("ruler", RULER),
    Case("ruler-from-jsonl-empty", cmd(RULER, from_jsonl="{in}/niah_single_1.jsonl"), {"niah_single_1.jsonl": EMPTY},
         match="{in}/niah_single_1.jsonl holds no records"),
    Case("ruler-from-jsonl-binary", cmd(RULER, from_jsonl="{in}/niah_single_1.jsonl"),
         {"niah_single_1.jsonl": BINARY}, match="--from-jsonl {in}/niah_single_1.jsonl is not UTF-8 text"),
    Case("ruler-from-jsonl-not-utf8", cmd(RULER, from_jsonl="{in}/niah_single_1.jsonl"),
         {"niah_single_1.jsonl": LATIN1_JSONL}, match="--from-jsonl {in}/niah_single_1.jsonl is not UTF-8 text"),
    Case("ruler-from-jsonl-line-not-object", cmd(RULER, from_jsonl="{in}/niah_single_1.jsonl"),
         {"niah_single_1.jsonl": NOT_AN_OBJECT}, match="{in}/niah_single_1.jsonl:1: a record must be a JSON object"),
    Case("ruler-from-jsonl-line-not-json", cmd(RULER, from_jsonl="{in}/niah_single_1.jsonl"),
         {"niah_single_1.jsonl": NOT_JSON}, match="{in}/niah_single_1.jsonl:1: not valid JSON"),
    Case("ruler-from-jsonl-missing", cmd(RULER, from_jsonl="{in}/missing.jsonl"),
         match="--from-jsonl {in}/missing.jsonl does not exist"),
    Case("ruler-from-jsonl-folder", cmd(RULER, from_jsonl="{in}/folder"), {"folder/x.jsonl": b"{}"},
         match="--from-jsonl {in}/folder is not a file"),
    Case("ruler-from-jsonl-record-past-context", cmd(RULER, from_jsonl="{in}/niah_single_1.jsonl"),
         {"niah_single_1.jsonl": json.dumps({"input": "word " * 5000, "outputs": ["1"], "length": 5000,
                                             "answer_prefix": " Answer:"}).encode()},
         match="prompt + 4 new tokens, over the model's context of 4096"),
    Case("ruler-lengths-past-context", cmd(RULER, lengths=5000),
         match="length 5000 exceeds the model's context of 4096"),
    Case("ruler-lengths-zero", cmd(RULER, lengths=0), match="--lengths '0' must list lengths of at least 1 tokens"),
    Case("ruler-lengths-not-numbers", cmd(RULER, lengths="long"),
         match="--lengths 'long' is not a comma-separated list of integers"),
    Case("ruler-samples-zero", cmd(RULER, samples=0), match="--samples and --max-new-tokens must be at least 1"),
    Case("ruler-samples-negative", cmd(RULER, samples=-1), match="--samples and --max-new-tokens must be at least 1"),
    Case("ruler-tail-zero", cmd(RULER, tail=0), match="--tail 0 must be an integer of at least 1"),
    Case("ruler-tail-covers-length", cmd(RULER, tail=256),
         match="--tail 256 plus --keep-first 1 leave no filled row at length 256"),
    Case("ruler-max-new-tokens-zero", cmd(RULER, max_new_tokens=0),
         match="--samples and --max-new-tokens must be at least 1"),
    Case("ruler-unknown-task", cmd(RULER, tasks="niah_single_9"), match="unknown RULER task(s) niah_single_9"),
    Case("ruler-unknown-region", cmd(RULER, region="middle"), match="unknown region 'middle'"),
    Case("ruler-unknown-variant", cmd(RULER, variants="exact,oracle"),
         match="--variants 'exact,oracle' names unknown variant(s) ['oracle']"),
    Case("ruler-identity-without-split-or-maps", cmd(RULER, maps=None, variants="exact,identity"),
         match="identity fill needs --split (or --maps"),
    Case("ruler-split-not-the-maps-without-ridge", cmd(RULER, variants="exact,identity", split=2),
         match="{maps} holds maps for split 3, not 2"),

    # --- loss ---
    *data_cases("loss", LOSS, EVALUATION_DATA_EMPTY),
    *maps_cases("loss", LOSS),
    Case("loss-context-past-model", cmd(LOSS, context=5000),
         match="--context 5000 exceeds the model's context of 4096 tokens"),
    Case("loss-context-one", cmd(LOSS, context=1), match="--context 1 is too small"),
    Case("loss-short-not-below-context", cmd(LOSS, short=256),
         match="--short 256 must be between 1 and --context - 1 (255)"),
    Case("loss-short-stride-zero", cmd(LOSS, short_stride=0), match="--short-stride 0 must be at least 1"),
    Case("loss-samples-zero", cmd(LOSS, samples=0), match="--samples 0 must be at least 1"),
    Case("loss-samples-negative", cmd(LOSS, samples=-2), match="--samples -2 must be at least 1"),
    Case("loss-tail-one", cmd(LOSS, tail=1), match="--tail 1 scores nothing"),
    Case("loss-tail-negative", cmd(LOSS, tail=-16), match="--tail -16 must be an integer of at least 1"),
    Case("loss-keep-first-negative", cmd(LOSS, keep_first=-1),
         match="--keep-first -1 must be an integer of at least 0"),
    Case("loss-ridge-without-maps", cmd(LOSS, maps=None, variants="exact,ridge"),
         match="the ridge variant needs --maps"),
    Case("loss-split-not-the-maps-without-ridge", cmd(LOSS, variants="exact,identity", split=2),
         match="{maps} holds maps for split 3, not 2"),
    Case("loss-chunk-zero", cmd(LOSS, chunk=0), match="--chunk must be at least 1, got 0"),

    # --- splice ---
    *data_cases("splice", SPLICE, EVALUATION_DATA_EMPTY),
    Case("splice-maps-other-model", cmd(SPLICE, model="{B}"), match="{maps} was fitted for another model"),
    Case("splice-maps-is-stats", cmd(SPLICE, maps="{stats}"),
         match="{stats} is not a ridgefill maps file (found: stats)"),
    Case("splice-maps-truncated-mid-data", cmd(SPLICE, maps="{in}/m.safetensors"),
         {"m.safetensors": cut("maps", "data")}, match=MAPS_CORRUPT),
    Case("splice-context-past-model", cmd(SPLICE, context=5000, tail=16),
         match="--context 5000 exceeds the model's context of 4096 tokens"),
    Case("splice-tail-covers-context", cmd(SPLICE, tail=256), match="--tail 256 covers the whole --context 256"),
    Case("splice-samples-zero", cmd(SPLICE, samples=0), match="--samples 0 must be at least 1"),
    Case("splice-needles-negative", cmd(SPLICE, needles=-1), match="--needles -1 must be 0 (NLL only) or more"),
    Case("splice-max-new-tokens-zero", cmd(SPLICE, needles=1, max_new_tokens=0),
         match="--max-new-tokens 0 must be at least 1"),
    Case("splice-layers-outside-filled-range", cmd(SPLICE, layers="1-2"),
         match="--layers 1-2 is outside the filled range 3-5"),
    Case("splice-layers-not-a-range", cmd(SPLICE, layers="5-3"), match="'5-3' is not a layer or an increasing range"),
    Case("splice-unknown-swap", cmd(SPLICE, swap="keys+queries"), match="'keys+queries' is not a component"),
    Case("splice-state-on-attention-model", cmd(SPLICE, swap="state"),
         match="--swap state needs a model with recurrent-state (linear-attention) layers"),
    Case("splice-unknown-fill", cmd(SPLICE, fill="oracle"), match="--fill 'oracle' is unknown"),
    Case("splice-identity-fill-split-not-the-maps", cmd(SPLICE, fill="identity", split=2),
         match="{maps} holds maps for split 3, not 2"),
    Case("splice-identity-fill-without-split", cmd(SPLICE, maps=None), match="identity fill needs --split (or --maps"),

    # --- longbench ---
    *maps_cases("longbench", LB),
    Case("longbench-data-empty-json", cmd(LB, data="{in}/lb.json"), {"lb.json": EMPTY},
         match="{in}/lb.json: not valid JSON"),
    Case("longbench-data-empty-jsonl", cmd(LB, data="{in}/lb.jsonl"), {"lb.jsonl": EMPTY},
         match="--data {in}/lb.jsonl holds no questions"),
    Case("longbench-data-binary", cmd(LB, data="{in}/lb.json"), {"lb.json": BINARY},
         match="--data {in}/lb.json is not UTF-8 text"),
    Case("longbench-data-not-utf8", cmd(LB, data="{in}/lb.jsonl"), {"lb.jsonl": LATIN1_JSONL},
         match="--data {in}/lb.jsonl is not UTF-8 text"),
    Case("longbench-data-line-not-object", cmd(LB, data="{in}/lb.jsonl"), {"lb.jsonl": NOT_AN_OBJECT},
         match="{in}/lb.jsonl:1: record is a JSON list, not an object"),
    Case("longbench-data-line-not-json", cmd(LB, data="{in}/lb.jsonl"), {"lb.jsonl": NOT_JSON},
         match="{in}/lb.jsonl:1: not valid JSON"),
    Case("longbench-data-json-not-a-list", cmd(LB, data="{in}/lb.json"), {"lb.json": b'{"_id": "x"}'},
         match="{in}/lb.json holds a JSON dict, not a list of records"),
    Case("longbench-data-record-missing-field", cmd(LB, data="{in}/lb.jsonl"), {"lb.jsonl": b'{"_id": "x"}\n'},
         match="{in}/lb.jsonl:1: missing field 'domain'"),
    Case("longbench-data-missing", cmd(LB, data="{in}/missing.json"),
         match="--data {in}/missing.json is neither a file nor a Hub dataset id"),
    Case("longbench-data-folder", cmd(LB, data="{in}/folder"), {"folder/lb.json": b"[]"},
         match="--data {in}/folder is neither a file nor a Hub dataset id"),
    Case("longbench-data-wrong-suffix", cmd(LB, data="{in}/lb.txt"), {"lb.txt": b"[]"},
         match="{in}/lb.txt is neither .json nor .jsonl"),
    Case("longbench-max-len-past-context", cmd(LB, max_len=5000),
         match="--max-len 5000 tokens plus 1 answer tokens exceed the model's context of 4096"),
    Case("longbench-max-len-one", cmd(LB, max_len=1), match="--max-len must be at least 2 tokens, got 1"),
    Case("longbench-limit-zero", cmd(LB, limit=0), match="--limit must be at least 1, got 0"),
    Case("longbench-limit-negative", cmd(LB, limit=-1), match="--limit must be at least 1, got -1"),
    Case("longbench-max-new-tokens-zero", cmd(LB, "--mode", "generate", max_new_tokens=0),
         match="--max-new-tokens must be at least 1, got 0"),
    Case("longbench-unknown-mode", cmd(LB, mode="guess"), match="unknown --mode 'guess'"),
    Case("longbench-split-not-the-maps-without-ridge", cmd(LB, variants="exact,identity", split=2),
         match="{maps} holds maps for split 3, not 2"),

    # --- bench-ttft ---
    *maps_cases("bench-ttft", TTFT),
    Case("bench-ttft-data-empty", cmd(TTFT, data="{in}/empty.txt"), {"empty.txt": EMPTY},
         match="--data {in}/empty.txt holds no text"),
    Case("bench-ttft-data-binary", cmd(TTFT, data="{in}/binary.txt"), {"binary.txt": BINARY},
         match="--data {in}/binary.txt is not UTF-8 text"),
    Case("bench-ttft-data-jsonl-not-utf8", cmd(TTFT, data="{in}/latin1.jsonl"), {"latin1.jsonl": LATIN1_JSONL},
         match="--data {in}/latin1.jsonl is not UTF-8 text"),
    Case("bench-ttft-data-missing", cmd(TTFT, data="{in}/missing.txt"), match="unknown data '{in}/missing.txt'"),
    Case("bench-ttft-lengths-past-context", cmd(TTFT, lengths="32,5000"),
         match="--lengths 5000 exceeds the model's context of 4096 tokens"),
    Case("bench-ttft-lengths-one", cmd(TTFT, lengths=1), match="--lengths '1' must list lengths of at least 2 tokens"),
    Case("bench-ttft-repeats-zero", cmd(TTFT, repeats=0), match="--repeats must be >= 1 and --warmup >= 0 (got 0, 0)"),
    Case("bench-ttft-repeats-negative", cmd(TTFT, repeats=-1),
         match="--repeats must be >= 1 and --warmup >= 0 (got -1, 0)"),
    Case("bench-ttft-warmup-negative", cmd(TTFT, warmup=-1),
         match="--repeats must be >= 1 and --warmup >= 0 (got 1, -1)"),
    Case("bench-ttft-tail-zero", cmd(TTFT, tail=0), match="--tail 0 must be an integer of at least 1"),
    Case("bench-ttft-threads-negative", cmd(TTFT, threads=-1),
         match="--threads must be >= 0 (0 keeps torch's default), got -1"),
    Case("bench-ttft-unknown-projection", cmd(TTFT, projection="cuda"), match="unknown --projection 'cuda'"),
    Case("bench-ttft-exact-only", cmd(TTFT, variants="exact"),
         match="--variants needs at least one of identity, ridge besides exact"),
    Case("bench-ttft-chunk-zero", cmd(TTFT, chunk=0), match="--chunk must be at least 1, got 0"),
    Case("bench-ttft-unknown-device", cmd(TTFT, device="cuda:0"), match="unknown device 'cuda:0': use auto, cpu"),
    Case("bench-ttft-unknown-dtype", cmd(TTFT, dtype="fp64"), match="unknown dtype 'fp64': use auto, fp32, bf16"),

    # --- serve (every check runs before vLLM would start; the launch itself is replaced by a failure) ---
    *maps_cases("serve", SERVE),
    Case("serve-maps-for-another-layer-count", cmd(SERVE, maps="{in}/m.safetensors"),  # A with 7 layers: another model
         {"m.safetensors": maps_with(n_layers=7)},
         match="{in}/m.safetensors holds maps for a 7-layer model, {A} has 6 layers"),
    Case("serve-maps-option-missing", cmd(SERVE, maps=None),
         match="give --maps (from ridgefill fit), --split (identity fill) or --serving-config"),
    Case("serve-model-unsupported-architecture", cmd(SERVE, model="{in}/model"),
         model_folder(config_json=b'{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'),
         match="{in}/model is a GPT2LMHeadModel model: ridgefill's vLLM plugin serves"),
    Case("serve-model-config-binary", cmd(SERVE, model="{in}/model"), model_folder(config_json=BINARY),
         match="cannot read {in}/model/config.json"),
    Case("serve-model-config-nested", cmd(SERVE, model="{in}/model"), model_folder(config_json=NESTED),
         match="cannot read {in}/model/config.json (RecursionError)"),
    Case("serve-model-without-config", cmd(SERVE, model="{in}/model"), model_folder(config_json=None),
         match="{in}/model has no config.json"),
    Case("serve-model-missing", cmd(SERVE, model="{in}/no-model"), match="unknown model '{in}/no-model'"),
    Case("serve-tail-zero", cmd(SERVE, tail=0), match="--tail 0 must be an integer of at least 1"),
    Case("serve-tail-negative", cmd(SERVE, tail=-4), match="--tail -4 must be an integer of at least 1"),
    Case("serve-keep-first-negative", cmd(SERVE, keep_first=-1),
         match="--keep-first -1 must be an integer of at least 0"),
    Case("serve-outlier-factor-negative", cmd(SERVE, outlier_factor=-1),
         match="--outlier-factor -1 must be 0 (fill every row) or a finite positive number"),
    Case("serve-port-zero", cmd(SERVE, port=0), match="--port 0 is out of range: use 1..65535"),
    Case("serve-port-too-large", cmd(SERVE, port=70000), match="--port 70000 is out of range: use 1..65535"),
    Case("serve-port-not-a-number", cmd(SERVE, port="http"),
         match="Invalid value for '--port': Input should be a valid integer"),
    Case("serve-unknown-dtype", cmd(SERVE, dtype="fp8"), match="unknown dtype 'fp8'"),
    Case("serve-enable-lora", cmd(SERVE, "--enable-lora"), match="--enable-lora: LoRA is not supported with RidgeFill"),
    Case("serve-model-as-positional-argument", ["serve", "{A}", *SERVE[3:]],
         match="unexpected argument '{A}': serve takes the model as --model"),
    Case("serve-enable-lora-spelled-vllms-way", cmd(SERVE, "--enable_lora"),
         match="--enable_lora: LoRA is not supported with RidgeFill"),

    # --- run ---
    Case("run-recipe-empty", RUN, {"recipe.toml": EMPTY}, match="{in}/recipe.toml: model: missing (required)"),
    Case("run-recipe-binary", RUN, {"recipe.toml": BINARY}, match="recipe {in}/recipe.toml is not UTF-8 text"),
    Case("run-recipe-not-utf8", RUN, {"recipe.toml": ('name = "café"\n' + RECIPE).encode("latin-1")},
         match="recipe {in}/recipe.toml is not UTF-8 text"),
    Case("run-recipe-not-toml", RUN, {"recipe.toml": RECIPE + "[loss\n"},
         match="{in}/recipe.toml: invalid TOML: Expected ']' at the end of a table declaration"),
    Case("run-recipe-missing", cmd(RUN[:1] + ["{in}/missing.toml"] + RUN[2:]),
         match="recipe {in}/missing.toml does not exist"),
    Case("run-recipe-folder", cmd(RUN[:1] + ["{in}/folder"] + RUN[2:]), {"folder/a.toml": RECIPE},
         match="recipe {in}/folder is a folder, not a file"),
    Case("run-recipe-splits-wrong-type", RUN, {"recipe.toml": RECIPE.replace("splits = 3", 'splits = "three"')},
         match='{in}/recipe.toml: splits: expected an integer or a list of integers, got "three"'),
    Case("run-recipe-option-wrong-type", RUN, {"recipe.toml": RECIPE.replace("tokens = 1024", 'tokens = "many"')},
         match='{in}/recipe.toml: [calibrate].tokens: expected an integer, got "many"'),
    Case("run-recipe-tokens-zero", RUN, {"recipe.toml": RECIPE.replace("tokens = 1024", "tokens = 0")},
         match="{in}/recipe.toml: [calibrate]: --tokens must be >= 1"),
    Case("run-recipe-unknown-key", RUN, {"recipe.toml": "modle = 1\n" + RECIPE},
         match="{in}/recipe.toml: modle: unknown key (did you mean model?)"),
    Case("run-recipe-unknown-option", RUN, {"recipe.toml": RECIPE + "lamda = 1\n"},
         match="{in}/recipe.toml: [fit].lamda: unknown option (did you mean lam?)"),
    Case("run-recipe-unknown-step", RUN, {"recipe.toml": RECIPE + "[perplexity]\n"},
         match="{in}/recipe.toml: [perplexity]: unknown step"),
    Case("run-recipe-unknown-device", RUN, {"recipe.toml": 'device = "gpu"\n' + RECIPE},
         match="{in}/recipe.toml: device: unknown device 'gpu': use auto, cpu or cuda"),
    Case("run-recipe-unknown-dtype", RUN, {"recipe.toml": 'dtype = "half"\n' + RECIPE},
         match="{in}/recipe.toml: dtype: unknown dtype 'half': use auto, fp32, bf16, fp16"),
    Case("run-recipe-device-wrong-type", RUN, {"recipe.toml": "device = 0\n" + RECIPE},
         match="{in}/recipe.toml: device: expected a string, got 0"),
    Case("run-recipe-step-data-missing", RUN, {"recipe.toml": RECIPE + '[loss]\ndata = "{in}/missing.txt"\n'},
         match="{in}/recipe.toml: [loss].data: {in}/missing.txt does not exist"),
    Case("run-recipe-split-out-of-range", RUN, {"recipe.toml": RECIPE.replace("splits = 3", "splits = 9")},
         match="{in}/recipe.toml: splits: 9 is out of range: use 1..5"),
    Case("run-override-wrong-type", RUN + ["calibrate.tokens=many"], {"recipe.toml": RECIPE},
         match='override calibrate.tokens=many: expected an integer, got "many"'),
    Case("run-override-unknown-step", RUN + ["perplexity.samples=2"], {"recipe.toml": RECIPE},
         match="override perplexity.samples=2: unknown step"),

    # --- report ---
    Case("report-folder-empty", REPORT, {"results/.keep": EMPTY},
         match="{in}/results holds no ridgefill result documents"),
    Case("report-folder-missing", REPORT, match="{in}/results is not a folder"),
    Case("report-folder-is-a-file", REPORT, {"results": b"{}"}, match="{in}/results is not a folder"),
    Case("report-results-empty-and-binary", REPORT, {"results/a.json": EMPTY, "results/b.json": BINARY},
         match="{in}/results holds no ridgefill result documents"),
    Case("report-result-truncated", REPORT, {"results/loss.json": lambda found: found.result.read_bytes()[:200]},
         match="{in}/results holds no ridgefill result documents"),
    Case("report-result-without-results", REPORT, {"results/loss.json": result_with(results=None)},
         match="{in}/results/loss.json is not a complete `ridgefill loss` result (no 'results')"),
    Case("report-result-wrong-type", REPORT, {"results/loss.json": result_with(results=[1, 2])},
         match="{in}/results/loss.json is not a complete `ridgefill loss` result ('results' is a JSON list)"),
    Case("report-manifest-not-an-object", REPORT,
         {"results/manifest.json": b"[1, 2]", "results/loss.json": copy_of("result")},
         match="{in}/results/manifest.json is not a ridgefill run manifest"),
    Case("report-tolerance-negative", REPORT + ["--tolerance", "-1"], {"results/loss.json": copy_of("result")},
         match="--tolerance -1.0 must be 0 or more"),

    # --- fingerprint (issue #24): maps fitted on A do not pass for A's weights under another config or tokenizer ---
    Case("fingerprint-maps-for-another-rope-theta", cmd(GEN, model="{in}/model"),
         model_folder(config_json=lambda found: json.dumps({
             **(c := json.loads((found.A / "config.json").read_text())),
             "rope_parameters": {**c["rope_parameters"], "rope_theta": 500000.0}}).encode()),
         match="{maps} was fitted for another model"),
    Case("fingerprint-maps-for-another-tokenizer-merges", cmd(GEN, model="{in}/model"),
         model_folder(tokenizer_json=lambda found: json.dumps({
             **(t := json.loads((found.A / "tokenizer.json").read_text())),
             "model": {**t["model"], "merges": t["model"]["merges"][:-1]}}).encode()),
         match="{maps} was fitted for another model"),
    Case("fingerprint-maps-for-another-special-token", cmd(GEN, model="{in}/model"),
         model_folder(tokenizer_config_json=lambda found: json.dumps({
             **json.loads((found.A / "tokenizer_config.json").read_text()), "eos_token": "<unk>"}).encode()),
         match="{maps} was fitted for another model"),
    Case("fingerprint-model-without-tokenizer", cmd(GEN, model="{in}/model"),
         model_folder(tokenizer_json=None, tokenizer_config_json=None),
         match="cannot load the tokenizer of model {in}/model"),

    # --- outputs that cannot be written or would destroy an input: refused before any work (issue #24) ---
    # the statistics survive: {out} unchanged
    Case("output-fit-out-is-its-stats", cmd(FIT, stats="{out}/stats.safetensors", out="{out}/stats.safetensors"),
         {"out/stats.safetensors": copy_of("stats")}, match="--out {out}/stats.safetensors is the file --stats reads"),
    Case("output-key-scale-out-is-its-maps", cmd(KS, maps="{out}/maps.safetensors", out="{out}/maps.safetensors"),
         {"out/maps.safetensors": copy_of("maps")}, match="--out {out}/maps.safetensors is the file --maps reads"),
    Case("output-longbench-out-is-its-data", cmd(LB, data="{out}/lb.jsonl", out="{out}/lb.jsonl"),
         {"out/lb.jsonl": copy_of("lb")}, match="--out {out}/lb.jsonl is the file --data reads"),
    *[Case(f"output-{name}-out-is-a-folder", BASES[name], {f"out/{Path(BASES[name][-1]).name}/keep.txt": b"x"},
           match=f"--out {BASES[name][-1]} is an existing folder")
      for name in ("calibrate", "fit", "loss", "bench-ttft", "ruler", "splice", "longbench", "key-scale")],
    Case("output-fit-summary-is-a-folder", FIT, {"out/maps.safetensors.json/keep.txt": b"x"},
         match="{out}/maps.safetensors.json (written beside it) is an existing folder"),
    Case("output-calibrate-checkpoint-is-a-folder", CAL, {"out/stats.safetensors.partial/keep.txt": b"x"},
         match="{out}/stats.safetensors.partial (written beside it) is an existing folder"),
    Case("output-loss-folder-is-a-file", cmd(LOSS, out="{out}/file/loss.json"), {"out/file": b"x"},
         match="--out {out}/file/loss.json cannot be written: {out}/file is a file, not a folder"),
    Case("output-run-recipe-name-dot-dot", RUN, {"recipe.toml": RECIPE.replace('name = "bad"', 'name = ".."')},
         match='name: ".." is not a plain folder name'),

    # --- NaN and Inf in statistics and maps, misshapen maps (issue #24): refused where they load ---
    Case("nonfinite-fit-stats-nan", cmd(FIT, stats="{in}/s.safetensors"),
         {"s.safetensors": changed_tensor("stats", "s3.train.xtx", first_set(float("nan")))},
         match="holds a NaN or an infinity in split 3's train statistics (s3.train.xtx): recalibrate"),
    Case("nonfinite-fit-stats-inf", cmd(FIT, stats="{in}/s.safetensors"),
         {"s.safetensors": changed_tensor("stats", "s3.val.xty", first_set(float("inf")))},
         match="holds a NaN or an infinity in split 3's val statistics (s3.val.xty): recalibrate"),
    Case("nonfinite-generate-maps-nan-weight", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": changed_tensor("maps", "weight", first_set(float("nan")))},
         match="{in}/m.safetensors holds a NaN or an infinity in weight: refit"),
    Case("nonfinite-loss-maps-nan-weight", cmd(LOSS, maps="{in}/m.safetensors"),
         {"m.safetensors": changed_tensor("maps", "weight", first_set(float("nan")))},
         match="{in}/m.safetensors holds a NaN or an infinity in weight: refit"),
    Case("nonfinite-key-scale-maps-inf-bias", cmd(KS, maps="{in}/m.safetensors"),
         {"m.safetensors": changed_tensor("maps", "bias", first_set(float("-inf")))},
         match="{in}/m.safetensors holds a NaN or an infinity in bias: refit"),
    Case("nonfinite-generate-maps-bias-misshapen", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": changed_tensor("maps", "bias", lambda t: t[:, :-1])},
         match="{in}/m.safetensors has bias of shape [2, 63], not [2, 64]"),
    Case("nonfinite-loss-maps-bias-not-float", cmd(LOSS, maps="{in}/m.safetensors"),
         {"m.safetensors": changed_tensor("maps", "bias", lambda t: t.int())},
         match="{in}/m.safetensors holds bias as torch.int32, not floating point"),
    # --- issue #24: option values, files whose content does not add up, serving configs, tune, lm-eval, demo ---
    Case("fill-generate-outlier-factor-nan", cmd(GEN, outlier_factor="nan"),
         match="--outlier-factor nan must be 0 (fill every row) or a finite positive number"),
    Case("fill-loss-outlier-factor-inf", cmd(LOSS, outlier_factor="inf"),
         match="--outlier-factor inf must be 0 (fill every row) or a finite positive number"),
    Case("fill-serve-outlier-factor-nan", cmd(SERVE, outlier_factor="nan"),
         match="--outlier-factor nan must be 0 (fill every row) or a finite positive number"),
    Case("fill-generate-maps-without-bias", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": without("maps", tensor="bias")}, match="{in}/m.safetensors is incomplete ('bias')"),
    Case("fill-generate-maps-without-split", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": without("maps", meta_key="split")},
         match="{in}/m.safetensors has no valid `split` in its ridgefill metadata"),
    Case("fill-serve-maps-without-model", cmd(SERVE, maps="{in}/m.safetensors"),
         {"m.safetensors": without("maps", meta_key="model")},
         match="{in}/m.safetensors has no valid `model` in its ridgefill metadata"),
    Case("fill-generate-maps-split-past-the-layers", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": maps_with(split=9)}, match="{in}/m.safetensors holds split 9 of 6 layers"),
    Case("fill-generate-maps-key-scale-for-3-heads", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": with_key_scale(3)}, match="{in}/m.safetensors has key_scale of shape [3, 3], not [3, 2]"),
    Case("fill-serve-maps-key-scale-for-3-heads", cmd(SERVE, maps="{in}/m.safetensors"),
         {"m.safetensors": with_key_scale(3)}, match="{in}/m.safetensors has key_scale of shape [3, 3], not [3, 2]"),
    Case("fill-generate-maps-forged-weights-hash", cmd(GEN, maps="{in}/m.safetensors"),
         {"m.safetensors": maps_with(model={"id": "A", "weights_hash": "0123456789abcdef"})},
         match="{in}/m.safetensors was fitted for another model (A, weights 0123456789abcdef)"),
    Case("fill-calibrate-resume-with-another-lookback",
         cmd(CAL, "--resume", split="2,3", holdout=0.25, lookback=1),
         {"out/stats.safetensors.partial": partial_of_this_code()},
         match="{out}/stats.safetensors.partial was written with other settings (lookback None, now 1)"),
    Case("fill-generate-serving-config-nested", cmd(GEN, maps=None, serving_config="{in}/s.json"),
         {"s.json": NESTED}, match="--serving-config {in}/s.json: JSON nested too deeply to read"),
    Case("fill-generate-serving-config-ridge-maps-changed", cmd(GEN, maps=None, serving_config="{in}/s.json"),
         {"s.json": serving(sha256="0" * 64)},
         match="--serving-config {in}/s.json: its maps {maps} changed since tune"),
    Case("fill-generate-serving-config-ridge-maps-missing", cmd(GEN, maps=None, serving_config="{in}/s.json"),
         {"s.json": serving(maps="{A}/gone.safetensors", sha256="ab")},
         match="--serving-config {in}/s.json: its maps {A}/gone.safetensors do not exist"),
    Case("fill-bench-ttft-serving-config-ridge-without-maps", cmd(TTFT, maps=None, serving_config="{in}/s.json"),
         {"s.json": serving(maps=None)}, match="--serving-config {in}/s.json: a ridge fill without its maps"),
    Case("fill-serve-serving-config-ridge-tail-zero", cmd(SERVE, maps=None, serving_config="{in}/s.json"),
         {"s.json": serving(tail=0)}, match="--serving-config {in}/s.json: --tail 0 must be an integer of at least 1"),
    Case("fill-serve-serving-config-of-model-b", cmd(SERVE, maps=None, model="{B}", serving_config="{in}/s.json"),
         {"s.json": serving(variant="identity", maps=None)},
         match="--serving-config {in}/s.json was tuned for another model"),
    Case("fill-serve-serving-config-and-maps", cmd(SERVE, serving_config="{in}/s.json"), {"s.json": serving()},
         match="--serving-config sets the fill (maps and split): drop --maps and --split"),
    Case("data-loss-jsonl-text-not-a-string", cmd(LOSS, data="{in}/d.jsonl"), {"d.jsonl": b'{"text": 5}\n'},
         match="{in}/d.jsonl:1: record has no string field 'text'"),
    Case("tune-splits-past-the-layers", cmd(TUNE, splits="3-5"),
         match="--splits 3-5: split 5 is out of range: use 1..4"),
    Case("tune-tolerance-negative", cmd(TUNE, tolerance=-1),
         match="--tolerance -1 and --max-distant-gap 0.25 must be 0 or more"),
    Case("tune-unknown-variant", cmd(TUNE, variants="exact"),
         match="--variants 'exact': tune any of identity, ridge, drop, mean"),
    Case("tune-tail-zero", cmd(TUNE, tail=0), match="--tail 0 must be an integer of at least 1"),
    Case("tune-unknown-dtype", cmd(TUNE, dtype="int8"), match="unknown dtype 'int8': use auto, fp32, bf16, fp16"),
    Case("tune-data-missing", cmd(TUNE, data="{in}/missing.txt"), match="tune: data: {in}/missing.txt does not exist"),
    Case("tune-lengths-past-context", cmd(TUNE, lengths=5000),
         match="--lengths 5000 exceeds the model's context of 4096 tokens"),
    Case("tune-config-out-is-a-folder", cmd(TUNE, config_out="{in}/folder"), {"folder/x": b"x"},
         match="--config-out {in}/folder is an existing folder"),
    Case("lm-eval-model-args-tail-not-a-number", [*LM_EVAL, "pretrained={A},fill=identity,split=3,tail=abc"],
         match="model_args tail='abc' is not an integer"),
    Case("lm-eval-model-args-unknown-fill", [*LM_EVAL, "pretrained={A},fill=swift"], match="unknown fill 'swift'"),
    Case("lm-eval-model-args-unknown-dtype", [*LM_EVAL, "pretrained={A},dtype=fp64"],
         match="unknown dtype 'fp64': use auto, fp32, bf16, fp16"),
    Case("lm-eval-model-args-maps-of-model-b", [*LM_EVAL, "pretrained={B},maps={maps}"],
         match="{maps} was fitted for another model"),
    Case("demo-out-dir-is-a-file", ["demo", "--out-dir", "{in}/file"], {"file": b"x"},
         match="--out-dir {in}/file is a file, not a folder"),
    # --- issue #27: the null controls drop and mean ---
    Case("controls-loss-mean-without-maps", cmd(LOSS, maps=None, split=3, variants="exact,mean"),
         match="the mean variant needs --maps"),
    Case("controls-ruler-mean-maps-without-means", cmd(RULER, maps="{in}/m.safetensors", variants="exact,mean"),
         {"m.safetensors": changed_tensor("maps", "mean", lambda t: None)},
         match="carries no calibration means (fitted before ridgefill 0.3), which the mean control needs: refit"),
    Case("controls-splice-drop", cmd(SPLICE, fill="drop"), match="--fill drop writes no late-layer cache"),
    Case("controls-fit-mean-with-rank", cmd(FIT, kind="mean", rank=4), match="--kind mean fits no map"),
    Case("controls-loss-unknown-control", cmd(LOSS, variants="exact,zero"),
         match="--variants 'exact,zero' names unknown variant(s) ['zero']"),
    Case("controls-serve-serving-config-drop", cmd(SERVE, maps=None, serving_config="{in}/s.json"),
         {"s.json": serving(variant="drop", maps=None)}, match="the vLLM plugin does not serve drop fill"),
    # --- issue #27: the filled window below the split ---
    Case("window-calibrate-negative", cmd(CAL, filled_window=-4), match="--filled-window -4 must be an integer"),
    Case("window-calibrate-layers-at-the-split", cmd(CAL, filled_window=8, filled_window_layers="0-2"),
         match="reaches layer 2, at or above the split 2"),
    Case("window-calibrate-layers-not-a-range", cmd(CAL, filled_window=8, filled_window_layers="x"),
         match="--filled-window-layers 'x' is not a layer range"),
    Case("window-loss-layers-without-window", cmd(LOSS, filled_window_layers="0-1"),
         match="needs --filled-window W > 0"),
    Case("window-ruler-maps-without-window", cmd(RULER, filled_window=32),
         match="calibrated with full attention for its filled rows, not --filled-window 32"),
    Case("window-ruler-identity-layers-past-split", cmd(RULER, maps=None, split=2, variants="exact,identity",
                                                        filled_window=32, filled_window_layers="1-3"),
         match="reaches layer 3, at or above the split 2"),
    Case("window-serve-identity", cmd(SERVE, maps=None, split=3, filled_window=64),
         match="the vLLM plugin does not serve a filled window"),
    Case("window-serve-serving-config", cmd(SERVE, maps=None, serving_config="{in}/s.json"),
         {"s.json": serving(variant="identity", maps=None, split=3, filled_window=64)},
         match="the vLLM plugin does not serve a filled window"),
]

# a few cases again in a subprocess, through `python -m ridgefill`
END_TO_END = ["fit-stats-truncated-data", "generate-prompt-file-binary", "loss-maps-other-model",
              "serve-maps-other-model", "run-recipe-unknown-step", "report-manifest-not-an-object"]


# --- running a case -----------------------------------------------------------------------------------------
def _prepare(args: list[str], files: dict, found: Inputs, tmp: Path) -> tuple[list[str], dict, Path, Path]:
    """Write a case's files; returns (its arguments, the names they use, its output folder, the working folder)."""
    folders = {"in": tmp / "in", "out": tmp / "out", "cwd": tmp / "cwd"}
    for folder in folders.values():
        folder.mkdir()
    names = {**found.names(), "in": str(folders["in"]), "out": str(folders["out"])}
    for name, content in files.items():
        path = folders["out"] / name[4:] if name.startswith("out/") else folders["in"] / name
        if content is COPY_OF_A:
            shutil.copytree(found.A, path)
            continue
        if content is None:
            path.unlink()
            continue
        if callable(content):
            content = content(found)
        if isinstance(content, str):
            content = content.format(**names).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return [a.format(**names) if a.count("{") else a for a in args], names, folders["out"], folders["cwd"]


def _named(text: str, names: dict[str, str]) -> str:
    """`text` with the names of fixtures and folders ({in}, {maps}, ...) replaced by their paths."""
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text


def _main(args: list[str], cwd: Path, monkeypatch) -> int:
    """`ridgefill ARGS` in `cwd` through the console entry point; its exit code."""
    monkeypatch.chdir(cwd)
    return run_main(args, monkeypatch)


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(folder.rglob("*"))} if folder.exists() else {}


def _check(match: str, code: int, stderr: str, out: Path, before: dict, cwd: Path) -> None:
    assert "Traceback" not in stderr, stderr
    assert code == 2, f"exit code {code}, stderr:\n{stderr}"
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"not exactly one line on stderr:\n{stderr}"
    assert stderr.startswith("error: "), stderr
    assert match.lower() in stderr.lower(), f"the error does not say {match!r}: {stderr}"
    assert _listing(out) == before, f"files left in the output folder: {sorted(set(_listing(out)) - set(before))}"
    assert not any(cwd.iterdir()), f"files left in the working folder: {list(cwd.iterdir())}"


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, inputs, tmp_path, monkeypatch, capfd):
    args, names, out, cwd = _prepare(case.args, case.files, inputs, tmp_path)
    before = _listing(out)
    if case.args[0] == "serve":  # a check that let it through must not start a server
        from ridgefill.serve import serve

        monkeypatch.setattr(serve, "launch", lambda plan: pytest.fail(f"serve would start vLLM: {plan.argv}"))
    capfd.readouterr()
    code = _main(args, cwd, monkeypatch)
    _check(_named(case.match, names), code, capfd.readouterr().err, out, before, cwd)


@pytest.mark.parametrize("case", [c.param() for c in CASES if c.id in END_TO_END])
def test_bad_input_end_to_end(case, inputs, tmp_path):
    args, names, out, cwd = _prepare(case.args, case.files, inputs, tmp_path)
    before = _listing(out)
    r = subprocess.run([sys.executable, "-m", "ridgefill", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=300)
    _check(_named(case.match, names), r.returncode, r.stderr, out, before, cwd)


def test_cases_cover_every_command_and_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)
    assert set(END_TO_END) <= {c.id for c in CASES}
    commands = {c.args[0] for c in CASES}
    assert commands >= {"calibrate", "fit", "key-scale", "generate", "serve", "ruler", "loss", "splice", "longbench",
                        "bench-ttft",
                        "run", "report"}


@pytest.mark.parametrize("name", list(BASES))
def test_the_cases_base_commands_run(name, inputs, tmp_path, monkeypatch, capfd):
    """Every case changes one thing of a command line that works: the error comes from that change."""
    args, _, out, cwd = _prepare(BASES[name], {}, inputs, tmp_path)
    assert _main(args, cwd, monkeypatch) == 0, capfd.readouterr().err


def test_the_serve_base_command_passes_every_check(inputs, tmp_path, monkeypatch, capfd):
    """The serve cases' command line gets as far as starting vLLM (its installation's checks pass here)."""
    from ridgefill.serve import serve
    from ridgefill.backends.vllm.config import VLLM_VERSION
    from ridgefill.backends.vllm import serving as vserving

    args, _, _, cwd = _prepare(SERVE, {}, inputs, tmp_path)
    launched = []
    monkeypatch.setattr(vserving, "installed_vllm_version", lambda: VLLM_VERSION)
    monkeypatch.setattr(vserving, "plugin_installed", lambda: True)
    monkeypatch.setattr(serve, "launch", lambda plan: launched.append(plan.argv) or 0)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert _main(args, cwd, monkeypatch) == 0 and len(launched) == 1, capfd.readouterr().err


@pytest.mark.parametrize("name", ["calibrate", "fit", "loss", "bench-ttft"])
@pytest.mark.parametrize("above", ["file", "file/sub"], ids=["folder-is-a-file", "folder-under-a-file"])
def test_output_under_a_file_is_refused_before_any_work(name, above, inputs, tmp_path, monkeypatch, capfd):
    """--out in a folder that is a regular file, or that cannot be created because a folder above it is one: one
    line, exit 2, and no model is opened. No permission is involved, so it holds for root too."""
    from ridgefill.runtime.session import ModelConfig

    args, _, out, cwd = _prepare(BASES[name], {"out/file": b"x"}, inputs, tmp_path)
    target = out / above / Path(BASES[name][-1]).name
    args = args[:-1] + [str(target)]
    monkeypatch.setattr(ModelConfig, "open", lambda self, *args, **kwargs: pytest.fail("a model was opened"))
    before = _listing(out)
    capfd.readouterr()
    code = _main(args, cwd, monkeypatch)
    _check(f"--out {target} cannot be written: {out / 'file'} is a file, not a folder", code, capfd.readouterr().err,
           out, before, cwd)


@pytest.mark.parametrize("name", ["calibrate", "fit", "loss", "bench-ttft"])
def test_output_in_a_read_only_folder_is_refused_before_any_work(name, inputs, tmp_path, monkeypatch, capfd):
    """--out in a folder that cannot be written (mode 555): one line, exit 2, and no model is opened. Root may write
    in any folder, and CI runs as root: there the folder's access check answers as it does for every other user."""
    from ridgefill.runtime.session import ModelConfig

    args, _, out, cwd = _prepare(BASES[name], {}, inputs, tmp_path)
    locked = out / "locked"
    locked.mkdir()
    target = locked / Path(BASES[name][-1]).name
    args = args[:-1] + [str(target)]
    monkeypatch.setattr(ModelConfig, "open", lambda self, *args, **kwargs: pytest.fail("a model was opened"))
    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: (
            not mode & os.W_OK if Path(path) == locked else access(path, mode, **kwargs)))
    before = _listing(out)
    locked.chmod(0o555)
    try:
        capfd.readouterr()
        code = _main(args, cwd, monkeypatch)
        _check(f"--out {target} cannot be written: the folder {locked} is not writable", code,
               capfd.readouterr().err, out, before, cwd)
    finally:
        locked.chmod(0o755)


def test_a_case_must_name_its_own_message():
    """A case without a match, or with one too short to tell its refusal from another (an option's name), is an
    error where it is written."""
    with pytest.raises(TypeError, match="match"):
        Case("no-match", ["fit"])
    with pytest.raises(ValueError, match="too short"):
        Case("option-name", ["fit", "--rank", "0"], match="--rank")
    assert Case("own-words", ["fit", "--rank", "0"], match="--rank 0 is out of range").match
