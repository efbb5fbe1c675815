"""Maps as a GGUF adapter: a split's maps in the file llama.cpp loads, typed as its LoRA adapters are.

llama.cpp types an adapter file by `general.type = adapter` and `adapter.type` (`lora` for a LoRA), and checks its
`general.architecture` against the model's at load. A ridgefill adapter is `adapter.type = ridgefill`, the
architecture that of the model the maps were fitted for (its Hugging Face model_type as llama.cpp names it:
LLAMACPP_ARCH), and:

- keys under `ridgefill.`: the format version, the maps' kind and rank, the split, the model's block count, width and
  KV heads (named as llama.cpp names them under the architecture), the model's id and fingerprint (`weights_hash`),
  the calibration's data, tokens and sequence length, the fill's defaults (tail, keep-first, outlier factor) and the
  whole metadata record of the safetensors maps as JSON (`ridgefill.metadata`);
- tensors per late layer l, in llama.cpp's orientation (a [out, in] matrix, ne = [in, out], for ggml_mul_mat): for
  l = S+1..L-1 the map `blk.{l}.ridgefill.weight` (Wᵀ [H, F]) or its low-rank pair `.u` (Uᵀ [r, F]) and `.v`
  (Vᵀ [H, r]) with W = I + UV, `.bias` [H] and `.mean` [H] (the calibration mean, for the mean control); for
  l = S..L-1 `.key_scale` [Hkv] where there is one. The matrices are F16 (default) or F32; biases, means and key
  scales are always F32.

`write` writes one (atomically, nothing non-finite as stored); `read` reads one back into the tensors and metadata
of the safetensors maps (method/maps.py: load_maps, read_maps_meta), so every reader of maps reads it alike;
`check_for_model` refuses one for another architecture, layer count, width or KV heads.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ridgefill import __version__
from ridgefill.commands import option
from ridgefill.errors import RidgefillError
from ridgefill.method.fill_fields import FIELD
from ridgefill.runtime.artifacts import FIX_NONFINITE, check_finite, corrupt, read_private
from ridgefill.runtime.paths import atomic_path

SUFFIX = ".gguf"
MAGIC = b"GGUF"
ADAPTER_TYPE = "ridgefill"
FORMAT_VERSION = 1
GGUF_TYPES = ("f16", "f32")  # the matrices' type; biases, means and key scales are F32
LLAMACPP_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF model_type -> general.architecture
MATRICES = ("weight", "u", "v")
PER_MAP = (*MATRICES, "bias", "mean")  # one per map: layers S+1..L-1
TENSOR = re.compile(r"blk\.(\d+)\.ridgefill\.(\w+)")
K = "ridgefill."  # every key of ours
FIX = "rewrite it with ridgefill fit --out (or ridgefill convert-maps)"


def gguf_type_option():
    """--gguf-type, declared once (fit, convert-maps)."""
    return option(None, f"The maps' matrices in a {SUFFIX} --out: f16 (default) or f32 (biases, means and key scales "
                  "are f32 either way).")


def check_gguf_type(out, gguf_type: str | None) -> None:
    """--gguf-type: one of GGUF_TYPES, and only for a .gguf --out."""
    if gguf_type is None:
        return
    if gguf_type not in GGUF_TYPES:
        raise RidgefillError(f"unknown --gguf-type '{gguf_type}': use {' or '.join(GGUF_TYPES)}")
    if not is_gguf_path(out):
        raise RidgefillError(f"--gguf-type sets the type of a {SUFFIX} --out, and {out} is safetensors (fp32): drop "
                             f"--gguf-type, or name an --out ending in {SUFFIX}")


def is_gguf_path(path) -> bool:
    """Whether maps written to `path` go as a GGUF adapter (by its name)."""
    return Path(path).suffix.lower() == SUFFIX


def is_gguf(path) -> bool:
    """Whether the file at `path` is a GGUF file (by its first bytes); a missing or unreadable one is not."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# --- writing -------------------------------------------------------------------------------------------------------
def write(path, tensors: dict[str, torch.Tensor], meta: dict, gguf_type: str | None = None,
          fix: str | None = None, model: str | None = None) -> None:
    """Write a maps file's `tensors` (the safetensors names: weight [M, F, H] or u/v, bias, mean [M, H], key_scale
    [M+1, Hkv]; M = L-S-1) and `meta` as a GGUF adapter at `path`, atomically; maps llama.cpp cannot run (lookback,
    a filled window, a family it does not fill) and tensors not finite as stored are refused before anything is
    written. The model's architecture, width and KV heads come from meta["model"], else from the model it names
    (`model`: where it is now, when not there; its fingerprint must be the maps')."""
    import gguf

    gguf_type = gguf_type or GGUF_TYPES[0]
    meta = {k: v for k, v in meta.items() if k != "gguf"} | {"artifact": "maps", "ridgefill_version": __version__}
    _check_llamacpp_fills(path, meta)
    meta["model"] = model_facts(path, meta.get("model") or {}, meta.get("n_layers"), model)
    arch = _architecture(path, meta)
    check_finite(path, tensors, fix or FIX_NONFINITE["maps"])
    stored = _layer_tensors(tensors, meta["split"], gguf_type)
    if gguf_type == "f16":
        check_finite(path, {n: torch.from_numpy(a) for n, a in stored.items()}, "write them as f32 (--gguf-type f32)")
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, ADAPTER_TYPE)
        for key, value in _keys(meta, tensors, gguf_type):
            if isinstance(value, str):
                writer.add_string(K + key, value)
            elif isinstance(value, float):
                writer.add_float32(K + key, value)
            elif key.endswith("tokens"):
                writer.add_uint64(K + key, value)
            else:
                writer.add_uint32(K + key, value)
        for name, array in stored.items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def model_facts(path, fitted: dict, n_layers: int | None, where: str | None = None) -> dict:
    """The maps' model record (id, weights_hash) with the family, width, KV heads and layers an adapter records:
    as the metadata holds them (maps read from an adapter), else read from the model (runtime/models.model_identity,
    its config, no weights) at `where` or at the id it was fitted as, which must be that model (its fingerprint)."""
    if all(fitted.get(k) is not None for k in ("family", "hidden_size", "kv_heads")):
        return fitted
    from ridgefill.runtime.models import model_identity

    spec = str(where or fitted.get("id"))
    fix = ("write .safetensors maps, or convert them where that model is (ridgefill convert-maps --maps M --out "
           f"M{SUFFIX} --model MODEL)")
    try:
        info = model_identity(spec).info
    except RidgefillError as exc:
        raise RidgefillError(f"{path} not written: an adapter records the model's architecture, width and KV heads, "
                             f"and the model the maps were fitted for cannot be read at {spec} ({str(exc)[:160]}): "
                             f"{fix}") from None
    if info["weights_hash"] != fitted.get("weights_hash") or (n_layers and info["n_layers"] != n_layers):
        raise RidgefillError(f"{path} not written: {spec} is not the model the maps were fitted for (weights "
                             f"{info['weights_hash']}, the maps' {fitted.get('weights_hash')}): {fix}")
    return {**fitted, **{k: info[k] for k in ("family", "layers", "hidden_size", "kv_heads") if k in info}}


def _check_llamacpp_fills(path, meta: dict) -> None:
    """Refuse maps llama.cpp cannot run: lookback maps, maps calibrated with a filled window."""
    if meta.get("lookback") or meta.get("filled_window"):
        what = "lookback" if meta.get("lookback") else "a filled window"
        raise RidgefillError(f"{path} not written: maps with {what} have no llama.cpp form (it fills from the split "
                             "state alone, with full attention): write them as .safetensors")


def _architecture(path, meta: dict) -> str:
    """The llama.cpp architecture of the maps' model; one line for a family llama.cpp does not fill."""
    family = (meta.get("model") or {}).get("family")
    if family not in LLAMACPP_ARCH:
        raise RidgefillError(f"{path} not written: the maps are for a {family} model, and llama.cpp fills "
                             f"{', '.join(LLAMACPP_ARCH)} models: write them as .safetensors")
    return LLAMACPP_ARCH[family]


def _layer_tensors(tensors: dict[str, torch.Tensor], split: int, gguf_type: str) -> dict[str, np.ndarray]:
    """The GGUF tensors (name -> array as stored) of a maps file's stacked tensors: one per late layer, matrices
    transposed to [out, in]."""
    matrix = torch.float16 if gguf_type == "f16" else torch.float32
    out = {}
    for name, stacked in tensors.items():
        if name not in (*PER_MAP, "key_scale"):
            raise ValueError(f"maps tensor {name!r} has no GGUF form")
        first = split if name == "key_scale" else split + 1
        for i, t in enumerate(stacked.detach().float().cpu()):
            array = t.T.to(matrix) if name in MATRICES else t
            out[f"blk.{first + i}.ridgefill.{name}"] = np.ascontiguousarray(array.numpy())
    order = (*PER_MAP, "key_scale")
    return dict(sorted(out.items(), key=lambda item: (int(item[0].split(".")[1]),
                                                      order.index(item[0].split(".")[-1]))))


def _keys(meta: dict, tensors: dict[str, torch.Tensor], gguf_type: str) -> list[tuple[str, object]]:
    """The `ridgefill.` keys of an adapter (without the prefix)."""
    model = meta["model"]
    rank = tensors["u"].shape[2] if "u" in tensors else 0
    keys = [("format_version", FORMAT_VERSION), ("kind", meta["kind"]), ("rank", int(rank)),
            ("split", meta["split"]), ("block_count", meta["n_layers"]),
            ("embedding_length", model.get("hidden_size")), ("attention.head_count_kv", model.get("kv_heads")),
            ("model.id", str(model.get("id"))), ("model.weights_hash", model.get("weights_hash")),
            ("calibration.data", meta.get("data")), ("calibration.tokens", meta.get("tokens")),
            ("calibration.seq_len", meta.get("seq_len")), ("matrix_type", gguf_type),
            ("fill.tail", FIELD["tail"].default), ("fill.keep_first", FIELD["keep_first"].default),
            ("fill.outlier_factor", float(FIELD["outlier_factor"].default)),
            ("metadata", json.dumps(meta, separators=(",", ":")))]
    return [(k, int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v) for k, v in keys
            if v is not None]


# --- reading -------------------------------------------------------------------------------------------------------
def read(path, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(tensors, metadata, sha256) of a GGUF maps file, as the safetensors maps hold them (the tensors in float32):
    its bytes read once into private memory (load_private's rule), typed and parsed from there. A GGUF that is not a
    ridgefill adapter is one line."""
    read_meta(path)  # a model GGUF (gigabytes) is refused from its header, before its bytes are read
    data, digest = read_private(path, "maps", sha256)
    with _private_file(data) as f:
        tensors, meta = _parse(path, f, with_tensors=True)
    return tensors, meta, digest


def read_meta(path) -> dict:
    """The metadata of a GGUF maps file (its tensors not read)."""
    return _parse(path, str(path), with_tensors=False)[1]


@contextmanager
def _private_file(data: bytes) -> Iterator:
    """An open anonymous file holding `data` (memory where the system has memfd, else an unlinked temporary file: no
    name, so nobody else can change it), for gguf's reader, which maps a file."""
    fd = os.memfd_create("ridgefill-maps") if hasattr(os, "memfd_create") else None
    with os.fdopen(fd, "w+b") if fd is not None else tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        yield f


def _parse(path, source, with_tensors: bool) -> tuple[dict[str, torch.Tensor], dict]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(source)
        fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")
                  and not name.startswith("tokenizer.")}
    except Exception as exc:  # truncated, not GGUF after its magic
        raise corrupt(Path(path), "maps", exc) from None
    _check_adapter(path, fields)
    meta = _meta(path, fields)
    if not with_tensors:
        return {}, meta
    tensors = {}
    try:
        for t in reader.tensors:
            tensors[t.name] = _tensor(path, t)
    except RidgefillError:
        raise
    except Exception as exc:
        raise corrupt(Path(path), "maps", exc) from None
    return _stacked(path, tensors, meta), meta


def _check_adapter(path, fields: dict) -> None:
    """Refuse a GGUF that is not a ridgefill adapter (a model, a LoRA adapter), or one of a newer format."""
    kind, adapter = fields.get("general.type"), fields.get("adapter.type")
    if kind != "adapter" or adapter != ADAPTER_TYPE:
        found = (f"a {adapter} adapter" if kind == "adapter" else
                 f"a GGUF {kind or 'model'} of architecture {fields.get('general.architecture')}")
        raise RidgefillError(f"{path} is not a ridgefill maps file (found: {found}): pass the maps that `ridgefill "
                             f"fit --out maps{SUFFIX}` writes")
    version = fields.get(K + "format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise RidgefillError(f"{path} is a ridgefill adapter of format {version}, which this ridgefill (format "
                             f"{FORMAT_VERSION}) cannot read: upgrade ridgefill, or {FIX}")


def _meta(path, fields: dict) -> dict:
    """The maps' metadata: the record (`ridgefill.metadata`) under the typed keys, which llama.cpp reads, and the
    adapter's own facts under `gguf`."""
    try:
        record = json.loads(fields.get(K + "metadata") or "{}")
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise RidgefillError(f"{path} has no valid ridgefill.metadata (JSON of an object): {FIX}")
    typed = {k[len(K):]: v for k, v in fields.items() if k.startswith(K)}
    model = record.get("model") if isinstance(record.get("model"), dict) else {}
    model = {**model, "id": typed.get("model.id", model.get("id")), "weights_hash": typed.get("model.weights_hash")}
    meta = {**record, "artifact": "maps", "model": model}
    for key, name in (("kind", "kind"), ("split", "split"), ("n_layers", "block_count"), ("rank", "rank")):
        meta[key] = typed.get(name)
    meta["rank"] = meta["rank"] or None
    meta["gguf"] = {"architecture": fields.get("general.architecture"), "n_embd": typed.get("embedding_length"),
                    "n_head_kv": typed.get("attention.head_count_kv"), "matrix_type": typed.get("matrix_type"),
                    "fill": {k[5:]: v for k, v in typed.items() if k.startswith("fill.")}}
    return meta


def _tensor(path, t) -> torch.Tensor:
    """One tensor of the adapter, copied into float32 memory of its own; F16 or F32 only."""
    if t.tensor_type.name not in ("F16", "F32"):
        raise RidgefillError(f"{path} holds {t.name} as {t.tensor_type.name}; ridgefill maps are F16 or F32: {FIX}")
    return torch.from_numpy(np.array(t.data, dtype=np.float32, copy=True))


def _stacked(path, found: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """The safetensors maps' stacked tensors of an adapter's per-layer ones (matrices back to [in, out]): every
    name for every late layer it belongs to, nothing else."""
    split, n_layers = meta["split"], meta["n_layers"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (split, n_layers)):
        raise RidgefillError(f"{path} has no valid ridgefill.split and ridgefill.block_count (found {split!r}, "
                             f"{n_layers!r}): {FIX}")
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in found.items():
        match = TENSOR.fullmatch(name)
        if not match or match[2] not in (*PER_MAP, "key_scale"):
            raise RidgefillError(f"{path} holds a tensor {name}, which is no ridgefill map's: {FIX}")
        by_name.setdefault(match[2], {})[int(match[1])] = t.T if match[2] in MATRICES else t
    tensors = {}
    for name, layers in by_name.items():
        want = list(range(split if name == "key_scale" else split + 1, n_layers))
        if sorted(layers) != want:
            raise RidgefillError(f"{path} has {name} for layers {sorted(layers)}, not {want} (split {split} of "
                                 f"{n_layers} layers): {FIX}")
        try:
            tensors[name] = torch.stack([layers[l] for l in want]).contiguous()
        except RuntimeError:
            shapes = sorted({tuple(t.shape) for t in layers.values()})
            raise RidgefillError(f"{path} has {name} of several shapes {shapes} across layers: {FIX}") from None
    return tensors


# --- checked against a model ---------------------------------------------------------------------------------------
def check_for_model(path, meta: dict, model_info: dict, n_layers: int | None = None) -> None:
    """Refuse a GGUF maps file (meta["gguf"]) for another architecture, layer count, width or number of KV heads
    than the model's (what `model_info` states); the fingerprint is method/maps.check_for_model's."""
    found = meta["gguf"]
    arch = LLAMACPP_ARCH.get(model_info.get("family"), model_info.get("family"))
    layers = n_layers or model_info.get("layers")
    checks = [(found["architecture"], arch, "a {} model", "this model is {}"),
              (meta["n_layers"], layers, "a {}-layer model", "this model has {} layers"),
              (found["n_embd"], model_info.get("hidden_size"), "a model of width {}", "this model's is {}"),
              (found["n_head_kv"], model_info.get("kv_heads"), "a model with {} KV heads", "this model has {}")]
    for theirs, ours, fitted, this in checks:
        if ours is not None and theirs != ours:
            raise RidgefillError(f"{path} holds maps for {fitted.format(theirs)}, {this.format(ours)}: fit maps for "
                                 f"this model (ridgefill calibrate, then ridgefill fit --out maps{SUFFIX})")
