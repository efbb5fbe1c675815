"""The makings of tests/test_bad_input.py's cases: the inputs every case may name (Inputs), the bad files a case
writes, the Case record, each command's base arguments and the case families shared by several commands
(data_cases, maps_cases). The cases themselves: tests/bad_input_cases.py."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest


# --- the inputs every case may name ---------------------------------------------------------------------------------
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
CONVERT = ["convert-maps", "--maps", "{maps}", "--out", "{out}/maps.gguf"]
RUN = ["run", "{in}/recipe.toml", "--out-dir", "{out}/run"]
REPORT = ["report", "{in}/results"]
BASES = {"calibrate": CAL, "fit": FIT, "generate": GEN, "ruler": RULER, "loss": LOSS, "splice": SPLICE,
         "longbench": LB, "bench-ttft": TTFT, "key-scale": KS, "convert-maps": CONVERT}

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




# --- maps as a GGUF adapter (issue 57) ------------------------------------------------------------------------------
def gguf_rewritten(source: Path, keys: dict | None = None, drop: tuple[str, ...] = (), tensors: dict | None = None,
                   arch: str | None = None) -> bytes:
    """The bytes of GGUF file `source` written again with some keys' values replaced (their GGUF type kept; a new
    key: a string), keys and tensors in `drop` left out and `tensors` (name -> array, or (bytes, GGML type)) added: a
    file ridgefill's writer would not write."""
    import tempfile

    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    keys, reader = dict(keys or {}), GGUFReader(source)
    arch = arch or reader.fields["general.architecture"].contents()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rewritten.gguf"
        writer = GGUFWriter(str(out), arch)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
                continue
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, keys.pop(name, f.contents()), f.types[0], sub)
        for name, value in keys.items():
            writer.add_string(name, value)
        for t in reader.tensors:
            if t.name not in drop:
                writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        for name, array in (tensors or {}).items():  # an array, or (its bytes, their GGML type)
            data, kind = array if isinstance(array, tuple) else (array, None)
            writer.add_tensor(name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return out.read_bytes()


def gguf_maps(edit: Callable[[dict, dict], None] | None = None, model: str | None = None,
              **rewrite) -> Callable[[Inputs], bytes]:
    """The fixture's maps as a GGUF adapter (F32; `edit(tensors, meta)` first changes what is written, `model`: where
    its model is, checkpoint A by default), then rewritten (gguf_rewritten's keys, drop, tensors, arch)."""

    def written(found: Inputs) -> bytes:
        import tempfile

        from ridgefill.method.maps import load_maps, write_maps

        tensors, meta, _ = load_maps(found.maps)
        if edit is not None:
            edit(tensors, meta)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "maps.gguf"
            write_maps(path, tensors, meta, "f32", model=str(model or found.A))
            return gguf_rewritten(path, **rewrite) if rewrite else path.read_bytes()

    return written


def one_layer_more(tensors: dict, meta: dict) -> None:
    """An edit of gguf_maps: the maps of a 7-layer model like checkpoint A (the last map repeated)."""
    import torch

    for name, t in tensors.items():
        tensors[name] = torch.cat([t, t[-1:]])
    meta.update(n_layers=7, model={**meta["model"], "family": "llama", "hidden_size": 64, "kv_heads": 2})


def lookback_maps() -> Callable[[Inputs], bytes]:
    """The fixture's maps as lookback-1 maps (zero weights on the row before), shaped as their metadata says."""

    def edit(tensors: dict, meta: dict) -> None:
        import torch

        tensors["weight"] = torch.cat([tensors["weight"], torch.zeros_like(tensors["weight"])], dim=1)
        meta.update(lookback=1, lookback_start=1)

    return rewritten("maps", edit)
