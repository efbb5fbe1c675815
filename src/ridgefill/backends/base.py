"""The seam every engine that runs a fill goes through: what a backend can do (Capabilities), what it does
(Backend: greedy generation, timed prefill to the first token, next-token NLL of chosen rows, its tally), the
`--engine` option that generate, bench-ttft, ruler and loss share, and the one timing loop of bench-ttft.

A command never asks which engine runs: it asks the backend's capabilities. An option a backend cannot serve is
refused in one line naming the backend and the option (`check_engine_options`, from the flags), before anything
loads. A backend is built from the command's config (`open`): it reads the model as much as it needs (torchfill
loads it; an engine in another process reads only its identity and tokenizer) and exposes it as `model`, a
runtime/session.ModelFacts (tokenizer, shape, context_length, model_info, fingerprint: what plans and prompts
need). `use`
gets the variants to run side by side (name -> FillSettings, None for exact; and their torchfill.FillPlan, which
says which rows are filled: the one rule every engine follows), `start` readies them; every later call names a
variant.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from ridgefill.backends import DEFAULT_ENGINE, engine_help
from ridgefill.clock import clocked
from ridgefill.commands import Config, option
from ridgefill.torchfill.fill_plan import FillTally
from ridgefill.errors import RidgefillError

REFERENCE = "transformers"  # the timed name of transformers' own forward, beside exact (caps.reference_forward)


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs. A command that needs one it lacks is refused (check_engine_options)."""

    variants: tuple[str, ...]  # fill variants it runs beside exact (method/fill.FILLS)
    keep_rows: bool = False  # rows kept in full besides keep-first and the tail (--keep-rows, --keep-text)
    filled_window: bool = False  # local attention of filled rows below the split (--filled-window)
    lookback: bool = False  # maps that read the rows before a filled row (fit --lookback)
    key_scale: bool = False  # maps with a key-scale correction (ridgefill key-scale)
    logprobs: bool = False  # next-token log-probs of chosen prompt rows (loss)
    batching: bool = False  # several prompts per call, batched by the engine
    projection: bool = False  # torchfill's fused fill projection (--projection) and its timed share
    reference_forward: bool = False  # bench-ttft also times transformers' forward beside exact
    first_token_latency: bool = False  # the engine reports its own first-token latency per request
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")


@dataclass
class Generation:
    tokens: list[int]  # greedy tokens after the prompt (stops at end-of-sequence when asked)
    ttft_s: float  # prompt ids -> first generated token


@dataclass
class Timed:
    """One timed run of a prompt to its first token."""

    seconds: float
    token: int
    peak: dict = field(default_factory=lambda: {"peak_bytes": None, "increase_bytes": None})
    latency_s: float | None = None  # the engine's own first-token latency (first_token_latency)


class Backend:
    """One engine behind the seam. Subclasses set name, title, caps and implement the methods below; a backend
    module exposes its class as BACKEND and is named in backends/__init__.ENGINES."""

    name: ClassVar[str]
    title: ClassVar[str] = ""  # how results printed to stderr name it ("vLLM"; "" for torchfill)
    caps: ClassVar[Capabilities]

    @classmethod
    def check_installed(cls) -> None:
        """Refuse in one line (naming the fix) when the engine cannot run here."""

    @classmethod
    def cpu_only(cls) -> str | None:
        """Why this engine runs the model on the CPU alone whatever torch sees (None: it runs where torch does)."""
        return None

    @classmethod
    def provenance(cls) -> dict:
        """What computes this engine's results: result documents name it (`computed_by`) and cache keys hash it
        (runtime/provenance.result_versions: a recipe's steps, the exact store), so another version or build
        recomputes. The engine's name, and what every engine's results go through in ridgefill's own process:
        transformers (the tokenizer of every prompt) and torch (plans, scores of logits); an engine adds its own."""
        from ridgefill.runtime.provenance import versions

        found = versions(("torch", "transformers"))
        return {"engine": cls.name, "torch": found["torch"], "transformers": found["transformers"]}

    def __init__(self, config, projection: str = "auto") -> None:
        self.config = config  # the command's options: EngineOptions (engine, threads) and ModelConfig's
        self.model = None  # set by the subclass: the model as plans and prompts need it
        self.fills: dict = {}
        self.plans: dict = {}

    # --- variants ---------------------------------------------------------------------------------------------
    def use(self, fills: dict, plans: dict) -> "Backend":
        """The variants to run side by side: `fills` (name -> FillSettings, None: exact) whose plans are `plans`
        (name -> torchfill.FillPlan or None); maps the backend cannot serve are refused here."""
        check_plans(self, plans)
        self.fills, self.plans = dict(fills), dict(plans)
        return self

    def start(self, max_len: int) -> "Backend":
        """Get ready to run the variants (an engine in another process starts here); prompts plus generated
        tokens are at most `max_len` long. Use as a context manager: leaving it stops what was started."""
        return self

    def close(self) -> None:
        """Stop whatever `start` started."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- what commands ask ------------------------------------------------------------------------------------
    def generate(self, name: str, prompt: list[int], max_new_tokens: int, eos: int | None) -> Generation:
        """Greedy generation of variant `name` after its prefill of `prompt`; ends at `eos` (None: never). Its
        ttft_s is read from the one clock (`timed`), as `first_token`'s."""
        raise NotImplementedError

    def first_token(self, name: str, prompt: list[int], tag: str) -> Timed:
        """One timed run of `prompt` to the first greedy token (`tag`: unique per run, for engines that cache
        prefixes), timed by the one clock (`timed`)."""
        raise NotImplementedError

    def sync_device(self):
        """The device whose queued work the clock waits for before each read (None: the engine's calls return when
        their work is done: the CPU, or an engine in another process)."""
        return None

    def timed(self, run: Callable):
        """(seconds, run()) on the one clock of time to first token (ridgefill/clock.py): the device synchronised
        before each read."""
        return clocked(run, self.sync_device())

    def nll(self, name: str, ids, rows: list[int], targets):
        """NLL [B, len(rows)] (float32 tensor on the CPU) of targets [B, len(rows)], each predicted at its row of
        ids [B, N] (torch tensors) by variant `name` (caps.logprobs)."""
        raise NotImplementedError

    def tally(self, name: str) -> FillTally:
        """What variant `name` filled since `start`: rows filled, and rows run in full instead (outliers, lookback
        windows not whole)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The engine's own settings per variant, for the result document (empty: nothing beyond the config)."""
        return {}

    def device_info(self) -> dict:
        """Where it ran: device, dtype (and the routes torchfill took)."""
        raise NotImplementedError

    def fused_kv_bytes(self, split: int) -> int:
        """Bytes of the fused K/V projection weights the engine keeps for `split` (0: none)."""
        return 0

    def projection_time(self, name: str, prompt: list[int]) -> dict:
        """The fill projection's wall time in one more filled run, and its share (caps.projection)."""
        return {"projection_s": None, "projection_share": None, "instrumented_run_s": None}

    def check_filled(self, name: str, planned: int) -> None:
        """Refuse timings of variant `name` when it filled none of the `planned` rows it should have filled: they
        timed the engine's exact path (a fill that silently did not run: a plugin that did not load)."""
        filled = self.tally(name).filled_tokens
        check_filled(self.title or self.name, name, filled, planned, *self.unfilled_detail(name))

    def unfilled_detail(self, name: str) -> tuple[str, str]:
        """What the refusal of an unfilled variant adds: what ran instead (" (...)"), and what to check."""
        return "", ""

    def store_scope(self) -> dict:
        """What the exact store's scope adds for this engine beyond its provenance (which names the engine and its
        build: exact results of other engines differ), e.g. the file it runs."""
        return {}

    @property
    def chunk(self) -> int:
        """Prompt rows (of all prompts) scored at once by `nll` callers that batch windows."""
        return self.config.chunk


def refuse(backend, what: str, fix: str = "drop it") -> RidgefillError:
    """The one-line refusal of an option, input or capability a backend does not serve: every engine's refusals
    take this form."""
    name = backend if isinstance(backend, str) else backend.name
    return RidgefillError(f"{what} is not supported with --engine {name}: {fix}")


def check_needs(backend, needs: tuple[str, ...], fix: str = DEFAULT_ENGINE) -> None:
    """Refuse an engine that lacks a capability the command cannot run without (e.g. loss: logprobs; serve:
    serving), naming `fix`, an engine that has it."""
    cls = backend if isinstance(backend, type) else type(backend)
    for capability in needs:
        if not getattr(cls.caps, capability):
            raise refuse(cls.name, f"{capability.replace('_', ' ')}, which this command needs,",
                         f"use --engine {fix}")


def check_filled(engine: str, name: str, filled: int, planned: int, detail: str = "", check: str = "") -> None:
    """The one refusal of timings of a fill variant that filled none of its `planned` rows (every engine)."""
    if planned > 0 and filled == 0:
        raise RidgefillError(f"{name} filled none of the {planned} prompt rows it should have filled in {engine}"
                             f"{detail}: its timings are {engine}'s exact path's, so none are reported"
                             + (f"; {check}" if check else ""))


def check_plans(backend: Backend, plans: dict) -> None:
    """Plans a backend cannot run (a variant it lacks, a filled window, lookback or key-scale maps), refused before
    anything runs: the one check of what an engine runs, for every measuring command (Backend.use) and for serve
    (check_fill)."""
    for name, plan in plans.items():
        filler = getattr(plan, "filler", None)
        if filler is None:
            continue
        if getattr(plan, "window", None) is not None and not backend.caps.filled_window:
            raise refuse(backend, "a filled window (--filled-window, or one the maps carry)",
                         "use maps calibrated without a window")
        if getattr(filler, "lookback", 0) and not backend.caps.lookback:
            raise refuse(backend, f"maps with lookback {filler.lookback}", "use maps fitted without --lookback")
        if getattr(filler, "key_scale", None) is not None and not backend.caps.key_scale:
            raise refuse(backend, "maps with a key-scale correction", "use the maps before ridgefill key-scale")


def check_variants(backend, variants) -> None:
    """Refuse a fill variant the backend does not run (exact runs everywhere)."""
    cls = backend if isinstance(backend, type) else type(backend)
    lacking = [v for v in variants if v != "exact" and v not in cls.caps.variants]
    if lacking:
        raise refuse(cls.name, f"the {lacking[0]} variant", f"use {', '.join(['exact', *cls.caps.variants])}")


def check_fill(backend, fill, facts):
    """The plan of `fill` (method/fill.FillSettings) on the model `facts` describes, refused in one line where the
    backend cannot run it (check_variants, check_plans): serve's check, the same as the measuring commands'."""
    cls = backend if isinstance(backend, type) else type(backend)
    check_variants(cls, [fill.variant])
    check_options(cls, fill)
    plan, _ = fill.plan(facts)
    check_plans(cls, {fill.variant: plan})
    return plan


# --- the option the engine commands share ----------------------------------------------------------------

# (config field, set when, capability, the option as named in a refusal)
OPTION_CAPABILITIES: tuple[tuple[str, Callable, str, str], ...] = (
    ("keep_rows", lambda v: v is not None, "keep_rows", "--keep-rows"),
    ("keep_text", lambda v: v is not None, "keep_rows", "--keep-text"),
    ("filled_window", bool, "filled_window", "--filled-window"),
    ("projection", lambda v: v != "auto", "projection", "--projection"),
)


@dataclass
class EngineOptions(Config):
    """--engine: which backend runs the command (generate, bench-ttft, ruler, loss). `needs` names the
    capabilities the command cannot run without (e.g. loss: logprobs)."""

    engine: str = option(DEFAULT_ENGINE, engine_help())
    threads: int = option(0, "CPU threads the engine runs on (0: its default): torch's for torchfill, "
                          "the cores vLLM's threads are bound to, llama.cpp's threads (0: all cores).")
    needs: ClassVar[tuple[str, ...]] = ()

    def cpu_only(self) -> str | None:
        from ridgefill.backends import ENGINES, backend_class

        return backend_class(self.engine).cpu_only() if self.engine in ENGINES else None

    def check(self) -> None:
        super().check()
        check_engine_options(self, self.needs)

    def open_backend(self, projection: str = "auto") -> Backend:
        from ridgefill.backends import backend_class

        return backend_class(self.engine)(self, projection)


def check_options(cls, config) -> None:
    """Refuse an option set in `config` (a command's options, or FillSettings) that needs a capability `cls` lacks."""
    for name, is_set, capability, flag in OPTION_CAPABILITIES:
        if hasattr(config, name) and is_set(getattr(config, name)) and not getattr(cls.caps, capability):
            raise refuse(cls.name, flag)


def check_engine_options(config, needs: tuple[str, ...] = (), variants: list[str] | None = None) -> None:
    """--engine names a known backend that can run here, and the options asked for are ones it serves."""
    from ridgefill.backends import backend_class

    cls = backend_class(config.engine)
    cls.check_installed()
    check_needs(cls, needs)
    check_options(cls, config)
    if variants is None and getattr(config, "variants", None) is not None:
        from ridgefill.method.fill import parse_variants

        variants = parse_variants(config.variants, config.maps)
    check_variants(cls, variants or [])
    if config.device not in cls.caps.devices or config.dtype not in cls.caps.dtypes:
        raise refuse(cls.name, f"--device {config.device} --dtype {config.dtype}",
                     f"use a device of {', '.join(cls.caps.devices)} and a dtype of {', '.join(cls.caps.dtypes)}")


# --- the one timing loop ---------------------------------------------------------------------------------
def time_first_tokens(backend: Backend, names: list[str], prompt: list[int], repeats: int, warmup: int,
                      advance) -> tuple[dict[str, list[Timed]], dict[str, int]]:
    """Every name's timed runs of `prompt` to its first token: `warmup` untimed rounds, then `repeats` rounds,
    interleaved, the order rotating each round (no name always runs first); the garbage collector is emptied
    first. Returns the timed runs by name and each name's first token."""
    runs: dict[str, list[Timed]] = {name: [] for name in names}
    tokens: dict[str, int] = {}
    gc.collect()
    for w in range(warmup):
        for name in names:
            backend.first_token(name, prompt, f"ridgefill-bench:{len(prompt)}:warmup{w}")
            advance()
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            done = backend.first_token(name, prompt, f"ridgefill-bench:{len(prompt)}:{r}")
            runs[name].append(done)
            tokens[name] = done.token
            advance()
    return runs, tokens
