"""What every command does first: load the model and build its torchfill runner, quietly."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from ridgefill.commands import Config, option
from ridgefill.torchfill import Runner, ModelShape, Stopwatch
from ridgefill.torchfill.prefill import DEFAULT_CHUNK
from ridgefill.errors import RidgefillError
from ridgefill.runtime.device import DEVICE_HELP, DTYPE_HELP, check_device, resolve_device
from ridgefill.runtime.models import LoadedModel, load_model, load_tokenizer, model_identity, model_input


@dataclass
class ModelConfig(Config):
    """The options of every command that loads a model (a recipe sets them once, at its top level)."""

    model: str = option("smollm2-135m", "Local HF folder, Hub id, or alias 'smollm2-135m'.", top="model",
                        keyed=False)  # a recipe keys artifacts by the weights hash instead
    dtype: str = option("auto", DTYPE_HELP, top="dtype")
    device: str = option("auto", DEVICE_HELP, top="device")
    chunk: int = option(DEFAULT_CHUNK, "Prompt rows run at once (bounds activation memory).", top="chunk")

    def input_folders(self) -> dict:
        return model_input(self.model)

    def __post_init__(self) -> None:
        """`auto` resolved as the config is built: what the command keys, loads, relaunches with and records."""
        self.device, self.dtype = resolve_device(self.device, self.dtype, self.cpu_only())

    def cpu_only(self) -> str | None:
        """Why the program that runs this command's model runs on the CPU alone (None: it runs where torch does)."""
        return None

    def open(self, projection: str = "auto") -> "Session":
        """The model of these options, loaded, with its runner."""
        return open_session(self.model, self.dtype, self.device, self.chunk, projection)


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@dataclass
class Session:
    loaded: LoadedModel
    runner: Runner

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def model(self):
        """The transformers causal LM itself (what `model(ids)` runs: bench-ttft times its forward)."""
        return self.loaded.model

    @property
    def shape(self) -> ModelShape:
        """Layers, widths, heads, vocabulary and layer kinds of the model."""
        return self.runner.shape

    @property
    def context_length(self) -> int | None:
        """The model's context (max positions), None if it declares none."""
        return self.runner.context_length

    # what plans read of the model, as ModelFacts has it: identity (id, weights hash, family and widths), the
    # weights' hash, and the torch dtype and device the model runs in (what maps are loaded as)
    model_info = property(lambda self: self.loaded.info())
    fingerprint = property(lambda self: self.loaded.fingerprint)
    dtype = property(lambda self: self.runner.dtype)
    device = property(lambda self: self.runner.device)

    def facts(self) -> "ModelFacts":
        """What plans and prompts read of the model, as every engine's backend holds it (Backend.model)."""
        return ModelFacts(self.tokenizer, self.shape, self.context_length, self.model_info, self.fingerprint,
                          self.dtype, self.device)

    def timed_runner(self, timer: Stopwatch) -> Runner:
        """A second runner over the same loaded model whose fill projection adds its wall time to `timer`."""
        return self.runner.with_timer(timer)


@dataclass(frozen=True)
class ModelFacts:
    """The model as plans and prompts read it: every backend's `model`. An engine in another process reads it
    without the weights (model_facts: runtime/models.model_identity plus the tokenizer; maps are then loaded on the
    CPU in float32, for the plan's rows and FLOPs, and the engine loads its own); torchfill takes it from the model
    it loaded (Session.facts: its dtype and device)."""

    tokenizer: object
    shape: ModelShape
    context_length: int | None
    model_info: dict  # id, weights hash, family and widths
    fingerprint: str
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")


def model_facts(model: str) -> ModelFacts:
    """The model's identity and tokenizer, no weights loaded. Its model_info is what a loaded model's gives (no
    n_layers: `layers` says it), so a result's `model` has the same keys whichever engine ran."""
    quiet_libraries()
    identity = model_identity(model)
    info = {k: v for k, v in identity.info.items() if k != "n_layers"}
    return ModelFacts(load_tokenizer(model), identity.shape, identity.context_length, info, info["weights_hash"])


def open_session(model: str, dtype: str = "fp32", device: str = "cpu", chunk: int = DEFAULT_CHUNK,
                 projection: str = "auto") -> Session:
    """The model loaded (dtype and device may be auto) with its runner."""
    quiet_libraries()
    device, dtype = resolve_device(device, dtype)
    check_device(device, dtype)
    if chunk < 1:
        raise RidgefillError(f"--chunk must be at least 1, got {chunk}")
    loaded = load_model(model, dtype, device)
    return Session(loaded, Runner(loaded.adapter, chunk=chunk, projection=projection))


def check_length(flag: str, length: int, limit: int | None, fix: str = "lower it") -> None:
    """Refuse a prompt or sequence length, named by its option, that exceeds the model's context `limit` (None:
    the model states none), before any work."""
    if limit and length > limit:
        raise RidgefillError(f"{flag} {length} exceeds the model's context of {limit} tokens: {fix}")


def parse_splits(text: str, n_layers: int) -> list[int]:
    try:
        splits = sorted({int(s) for s in str(text).split(",") if s.strip()})
    except ValueError:
        raise RidgefillError(f"--split '{text}' is not a comma-separated list of integers") from None
    bad = [s for s in splits if not 1 <= s < n_layers]
    if not splits or bad:
        raise RidgefillError(f"split {bad or text} is out of range: use 1..{n_layers - 1} for this "
                             f"{n_layers}-layer model")
    return splits
