"""The command registry: every ridgefill command is one `Command`, a typed `Config` and a `run` function.

A command's options are the fields of its Config dataclass, each declared once with `option(default, help)`;
`Config.check` holds the command's own validation (everything that needs no model), and `run(config)` does the
work and returns the result document it wrote. The command line (cli.py) and recipe steps (pipeline/) are both
built from these declarations, so a recipe key and a command-line option are the same thing by construction.

    @dataclass
    class LossConfig(Config):
        samples: int = option(16, "Passages to score.")
        ...
    COMMAND = Command("loss", LossConfig, run, writes=".json", reads="maps")

A command that hands options on to another program names, as `extra_args`, the list[str] option that receives
every command-line argument it does not declare itself (`ridgefill serve --maps M --max-model-len 4096`: --maps
is serve's, --max-model-len goes to vLLM); `passthrough` hands on every argument, --help included (lm-eval).

Modules are imported only when their command is used (`ridgefill --help` stays instant): REGISTRY names each
command's module and one-line summary.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ridgefill.errors import RidgefillError


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of an option that must be given


@dataclass(frozen=True)
class Entry:
    module: str  # defines the command as `attribute`
    summary: str  # one line for `ridgefill --help`
    step: bool = False  # a recipe step: its --out is an artifact of the run folder
    attribute: str = "COMMAND"


REGISTRY: dict[str, Entry] = {
    "calibrate": Entry("ridgefill.method.calibrate", "One pass over calibration text: float64 statistics.", True),
    "fit": Entry("ridgefill.method.fit", "Fit per-layer maps in closed form; held-out error vs identity fill.", True),
    "key-scale": Entry("ridgefill.method.key_scale", "Refine maps: per-layer, per-KV-head scale of the filled keys."),
    "convert-maps": Entry("ridgefill.method.convert_maps", "Rewrite maps: safetensors ↔ a GGUF adapter (llama.cpp)."),
    "generate": Entry("ridgefill.evals.generate", "Generate greedily after exact or filled prefill (text on stdout)."),
    "serve": Entry("ridgefill.serve.serve", "Serve a model with RidgeFill through an engine's OpenAI-compatible server."),
    "ruler": Entry("ridgefill.evals.ruler", "RULER tasks with needles in filled rows: exact, identity, ridge.", True),
    "loss": Entry("ridgefill.evals.loss", "Teacher-forced tail NLL per variant, on all and distant tokens.", True),
    "splice": Entry("ridgefill.evals.splice", "Swap exact cache parts into the filled cache: what carries the error.",
                    True),
    "longbench": Entry("ridgefill.evals.longbench", "LongBench v2 accuracy for exact, identity and ridge prefill.", True),
    "bench-ttft": Entry("ridgefill.evals.bench_ttft", "Time to first token: exact vs filled vs transformers.", True),
    "bench-serve": Entry("ridgefill.evals.bench_serve", "Load test: RidgeFill in an engine's server against the "
                         "same server stock, under Poisson arrivals (loopback)."),
    "lm-eval": Entry("ridgefill.evals.lm_eval_cli", "lm-evaluation-harness with the `ridgefill` model registered."),
    "run": Entry("ridgefill.pipeline.run", "Run a recipe: calibrate → fit → evaluations, cached, with a report."),
    "tune": Entry("ridgefill.pipeline.tune", "Search the split to serve with: fewest exact layers within tolerance."),
    "report": Entry("ridgefill.pipeline.report", "Write report.md and PNG plots from the results in a run folder."),
    "demo": Entry("ridgefill.pipeline.run", "The main job on the embedded model: the quickstart recipe.",
                  attribute="DEMO"),
}


# --- options ------------------------------------------------------------------------------------------------
def option(default: Any, help: str, *, listed: type | None = None, top: str | None = None, role: str | None = None,
           fallback: str | None = None, keyed: bool = True, negatable: bool = False,
           positional: bool = False) -> Any:
    """One option of a command, as a dataclass field.

    listed: a comma-separated list of this type on the command line (a TOML list in a recipe).
    top: the recipe's top-level key that sets it (a step table may not), e.g. "model", "splits".
    role: what the recipe runner passes: "input" (the artifact an earlier step made), "output" (this step's
      artifact), "resume" (true: an interrupted step continues), "restart" (true only for a step given to
      `--force`: it starts over), "store" (a folder in the run folder, unless the table names one).
    fallback: the recipe's top-level key used when a step table leaves the option out (e.g. "data").
    keyed: False for options that cannot change the result (not part of a recipe's cache key).
    negatable: a boolean with a --no-<name> form. positional: a command-line argument, not an option.
    """
    meta = {"help": help, "listed": listed, "top": top, "role": role, "fallback": fallback, "keyed": keyed,
            "negatable": negatable, "positional": positional}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"ridgefill": meta})
    return dataclasses.field(default=default, metadata={"ridgefill": meta})


@dataclass(frozen=True)
class Option:
    name: str  # the config field, e.g. "seq_len"
    kind: type  # int, float, str, bool or Path (the element type of a repeatable option)
    default: Any  # REQUIRED when it must be given
    help: str
    optional: bool  # None is a valid value
    many: bool  # repeatable (list[...]): several values
    listed: type | None
    top: str | None
    role: str | None
    fallback: str | None
    keyed: bool
    negatable: bool
    positional: bool

    @property
    def flag(self) -> str:
        """The command-line name without dashes (also the recipe key), e.g. "seq-len"."""
        return self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def options(config: type) -> dict[str, Option]:
    """The options of a Config class, by flag, in declaration order."""
    hints = typing.get_type_hints(config)
    out = {}
    for f in dataclasses.fields(config):
        meta = f.metadata.get("ridgefill")
        if meta is None:
            continue
        kind, optional, many = _kind(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        opt = Option(f.name, kind, default, meta["help"], optional, many, meta["listed"], meta["top"], meta["role"],
                     meta["fallback"], meta["keyed"], meta["negatable"], meta["positional"])
        out[opt.flag] = opt
    return out


def _kind(hint) -> tuple[type, bool, bool]:
    """(element type, None allowed, repeatable) of a field's type hint."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], optional, True
    return hint, optional, False


# --- configs and commands ------------------------------------------------------------------------------------
@dataclass
class Config:
    """Base of every command's options. Subclasses are dataclasses whose fields are `option(...)`s."""

    def check(self) -> None:
        """The command's own validation of its options (no model loaded): a RidgefillError names the problem."""

    def wants_input(self) -> tuple[str, str, str] | None:
        """For an optional input artifact (e.g. --maps): (option, value, how to do without) when the options
        ask for it, e.g. ("variants", "ridge", "leave ridge out"); None when the command runs without it."""
        return None

    def input_folders(self) -> dict[str, Path]:
        """Folders the command reads that an option names by something other than their path (--model's alias: its
        cache folder), by option: runtime/paths.check_output refuses an output inside them as inside any input."""
        return {}

    def as_dict(self) -> dict:
        """Every option as given (paths as strings): the `config` of the result document."""
        return {f.name: (str(v) if isinstance(v, Path) else v) for f in dataclasses.fields(self)
                for v in [getattr(self, f.name)]}


@dataclass(frozen=True)
class Command:
    name: str
    config: type  # a Config dataclass
    run: Callable[[Any], Any]  # run(config) -> the result document (dict), or what the command returns
    writes: str | None = None  # suffix of the artifact --out writes; set for the commands that are recipe steps
    summary_json: bool = False  # --out also gets a <out>.json summary
    reads: str | None = None  # the option that takes an earlier step's artifact ("stats", "maps")
    makes: str | None = None  # what this step's artifact is to later steps ("stats", "maps")
    passthrough: bool = False  # every argument goes to another program (lm-eval)
    extra_args: str | None = None  # the list[str] option that gets every argument the command does not declare

    def __post_init__(self) -> None:
        if self.extra_args is not None:
            opt = next((o for o in self.options.values() if o.name == self.extra_args), None)
            if opt is None or not opt.many or opt.kind is not str or opt.positional:
                raise TypeError(f"{self.name}: extra_args names {self.extra_args!r}, which is not a list[str] option "
                                f"of {self.config.__name__}")

    @property
    def options(self) -> dict[str, Option]:
        return options(self.config)

    @property
    def summary(self) -> str:
        return REGISTRY[self.name].summary

    def make(self, **values) -> Config:
        """The config from option values (by field name); missing ones take their defaults."""
        unknown = sorted(set(values) - {o.name for o in self.options.values()})
        if unknown:
            raise RidgefillError(f"`ridgefill {self.name}` has no option {unknown[0]}: see 'ridgefill {self.name} "
                                 "--help'")
        config = self.config(**values)
        missing = [o for o in self.options.values() if o.required and getattr(config, o.name) is REQUIRED]
        if missing:
            raise RidgefillError(f"`ridgefill {self.name}` needs --{missing[0].flag}: {missing[0].help}")
        return config

    def __call__(self, **values):
        """Check and run with these option values: the one way every caller (CLI, recipes, tests) runs a command.
        A run that returns an int (not a bool) returns an exit code: the command line exits with it."""
        config = self.make(**values)
        config.check()
        return self.run(config)


def command(name: str) -> Command:
    """The command registered as `name` (its module is imported now)."""
    if name not in REGISTRY:
        raise RidgefillError(f"unknown command '{name}': use one of {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    return getattr(importlib.import_module(entry.module), entry.attribute)


def steps() -> list[str]:
    """The commands a recipe can run as steps, in pipeline order."""
    return [name for name, entry in REGISTRY.items() if entry.step]
