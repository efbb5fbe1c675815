"""The fill settings, each declared once: a FillField names a setting's FillSettings field (also its option, recipe
key, serving.json key and lm-eval model argument), type, default, check, help and the vLLM plugin's environment
variable. method/fill.py builds FillSettings, FillOptions, the plugin's environment and serving configs from FIELDS;
lm-eval's model arguments (evals/lm_eval_model.py) and tune's options (pipeline/tune/options.py) take theirs from
here too. The rules torchfill applies as well (tail, keep-first, outlier factor, window size) live in
torchfill/ and are named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ridgefill.commands import Config, option
from ridgefill.defaults import DEFAULT_KEEP_FIRST, DEFAULT_TAIL
from ridgefill.torchfill.rows import check_keep_first, check_outlier_factor, check_tail
from ridgefill.torchfill.window import check_window_size
from ridgefill.errors import RidgefillError
from ridgefill.method.statistics import OUTLIER_FACTOR

WINDOW_HELP = ("Filled rows attend only to the kept first rows and the W rows before them in the layers below the "
               "split (0: full attention; maps carry the window they were calibrated with).")
WINDOW_LAYERS_HELP = ("Layers 'a-b' (below the split) whose filled rows attend locally with --filled-window "
                      "(default: every layer below the split).")
OUTLIER_HELP = ("A row that would be filled runs in full when its split-state norm exceeds this x the median of "
                "its chunk's filled rows (calibration leaves such rows out of the fit); 0 fills them too.")


def check_split(split) -> None:
    """A split, when given: a layer index of at least 1 (its range is checked against the model)."""
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
        raise RidgefillError(f"--split {split} must be a layer index of at least 1")


@dataclass(frozen=True)
class FillField:
    """One fill setting, declared once. `name` is its FillSettings field, command-line option (--name with dashes),
    recipe key, serving.json key and lm-eval model argument; `kind` its type (`optional`: None allowed); `default`;
    `check(value)` raises the one-line error for a bad value (torchfill/ holds the rules torchfill applies
    too); `help` the option's help (None: no option); `env` the vLLM plugin's environment variable; `served`
    whether serving.json must have it ("required"; "optional": older configs may lack it and get the default;
    None: not a top-level key); `extra`: more of commands.option's keywords, as (key, value) pairs."""

    name: str
    kind: type
    default: Any
    check: Callable[[Any], Any] | None = None
    help: str | None = None
    env: str | None = None
    served: str | None = "required"
    optional: bool = False
    extra: tuple = ()

    def option(self, note: str | None = None, help: str | None = None):
        """The command option (a Config field); `note` is added to the help in parentheses, `help` (a command's own
        words for it) replaces it."""
        help = help or (self.help if note is None else f"{self.help[:-1]} ({note}).")
        return option(self.default, help, **dict(self.extra))

    def hint(self):
        return self.kind | None if self.optional else self.kind


FIELDS = (
    FillField("split", int, None, check_split, "Split S (the maps carry it; identity fill needs it without them).",
              optional=True, extra=(("top", "splits"),)),
    FillField("maps", Path, None, None, "Maps file (from ridgefill fit) for the ridge variant; it carries the split.",
              env="RIDGEFILL_MAPS", served=None, optional=True, extra=(("role", "input"),)),
    FillField("tail", int, DEFAULT_TAIL, check_tail, "Last prompt rows that run the full model.", env="RIDGEFILL_TAIL",
              extra=(("top", "tails"),)),
    FillField("keep_first", int, DEFAULT_KEEP_FIRST, check_keep_first, "Leading rows run in full (the attention sink).",
              env="RIDGEFILL_KEEP_FIRST"),
    FillField("outlier_factor", float, OUTLIER_FACTOR, check_outlier_factor, OUTLIER_HELP,
              env="RIDGEFILL_OUTLIER_FACTOR", served="optional"),
    FillField("maps_sha256", str, None, env="RIDGEFILL_MAPS_SHA256", served=None, optional=True),
    FillField("filled_window", int, 0, check_window_size, WINDOW_HELP, served="optional"),
    FillField("filled_window_layers", str, None, None, WINDOW_LAYERS_HELP, served="optional", optional=True),
)
FIELD = {f.name: f for f in FIELDS}
OPTIONS = tuple(f.name for f in FIELDS if f.help is not None)  # the fill options (FillOptions, lm-eval's model_args)
ENV = {f.name: f.env for f in FIELDS if f.env}  # the vLLM plugin's environment (read in every process vLLM starts)


def with_fields(names):
    """Class decorator (under @dataclass): add the FillFields `names` as fields, as options for a Config."""
    def add(cls):
        own = cls.__dict__.get("__annotations__", {})
        fields = {n: FIELD[n] for n in names}
        cls.__annotations__ = {**own, **{n: f.hint() for n, f in fields.items()}}
        for n, f in fields.items():
            setattr(cls, n, f.option() if issubclass(cls, Config) else f.default)
        return cls
    return add


def check_fill(**values) -> None:
    """Check the given fill settings by name, each with its FillField's check (one line naming the option)."""
    for name, value in values.items():
        if FIELD[name].check is not None:
            FIELD[name].check(value)


def check_fill_values(tail: int, keep_first: int, outlier_factor: float) -> None:
    """The fill's numbers (check_fill)."""
    check_fill(tail=tail, keep_first=keep_first, outlier_factor=outlier_factor)


def check_window_values(window: int, layers: str | None) -> None:
    """--filled-window and --filled-window-layers, before any model loads (their range is checked at the split)."""
    check_fill(filled_window=window)
    if layers is not None and not window:
        raise RidgefillError(f"--filled-window-layers {layers} needs --filled-window W > 0: pass a window or drop "
                             "the layers")


def env_number(env: Mapping[str, str], f: FillField):
    """The number the plugin's environment sets for `f` (its default when unset or empty); a one-line error for
    text that is no number."""
    text = env.get(f.env, "").strip()
    try:
        return f.kind(text) if text else f.default
    except ValueError:
        raise RidgefillError(f"{f.env}={text!r} is not a{'n integer' if f.kind is int else ' number'}: set it to e.g. "
                             f"{f.default}") from None
