"""Recipes: one TOML file, plus KEY=VALUE overrides from the command line, validated into step tables. Schema:
docs/recipes.md.

A recipe holds top-level settings (TOP) and one table per recipe step of the command registry (commands.steps()),
with that command's options under their command-line names. Names, types, defaults, lists, and which options
the top level or the runner sets all come from the commands' Config declarations (commands.py), so a step table
takes exactly the options its command declares, and nothing here names a step or a step's option.

An override `STEP.OPTION=VALUE` or `KEY=VALUE` (a top-level key) sets one value as if the file had it; the value
is read as a TOML value (a bare word is a string) and validated exactly like the file's, its errors naming the
override. Relative paths are read from the recipe's folder (an override's from the current folder).

Before any work, every task's config is built (with placeholder paths for what the runner wires) and its
command's own check runs, so option errors come out before the first step starts, not hours into a sweep.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ridgefill.commands import REQUIRED, Command, Option, command, steps
from ridgefill.defaults import DEFAULT_CHUNK, DEFAULT_TAIL
from ridgefill.errors import RidgefillError
from ridgefill.pipeline.plan import Task, plan, producer, task_values
from ridgefill.pipeline.recipe_toml import read_toml, toml_value

# Top-level keys: kind and default (REQUIRED: must be given). "ints": an integer or a list of them.
TOP = {
    "name": (str, None), "description": (str, ""), "model": (str, REQUIRED), "data": (str, None),
    "splits": ("ints", REQUIRED), "tails": ("ints", [DEFAULT_TAIL]), "seeds": ("ints", [0]), "lam": ("lam", "auto"),
    "dtype": (str, "auto"), "device": (str, "auto"), "chunk": (int, DEFAULT_CHUNK), "tolerance": (float, 5.0),
}
KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", Path: "a path (string)"}
NOUNS = {"stats": "statistics"}  # an artifact kind (Command.makes) in words, where it is not its own name
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".toml", ".gz")
WIRED = ("input", "output", "resume", "restart")  # roles of the options only the runner sets ("store": unless a table does)
RELATIVE = "relative paths are read from the recipe's folder, an override's from the current one"


@dataclass
class Recipe:
    path: Path
    text: str
    name: str
    settings: dict  # top-level values with defaults; splits / tails / seeds as sorted lists
    steps: dict[str, dict]  # step -> {option field: value} the table sets (and fallbacks), in pipeline order
    overrides: tuple[str, ...] = ()  # KEY=VALUE as given on the command line
    where: str | None = None  # what error messages name it by (default: its path)

    @property
    def named(self) -> str:
        return self.where or str(self.path)


@dataclass(frozen=True)
class Source:
    """Where each value came from, for error messages: the recipe file, or an override."""

    path: Path
    overrides: dict  # (step or None, key) -> the override's text

    def at(self, key: str, step: str | None = None) -> str:
        text = self.overrides.get((step, key))
        if text is not None:
            return f"override {text}"
        return f"{self.path}: [{step}].{key}" if step else f"{self.path}: {key}"

    def base(self, key: str, step: str | None = None) -> Path:
        """The folder relative paths are read from."""
        return Path.cwd() if (step, key) in self.overrides else self.path.resolve().parent


def find_recipe(spec: str | Path) -> Path:
    """A recipe file, or the name of a shipped one (recipes/NAME.toml here or in the source checkout)."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for folder in (Path("recipes"), Path(__file__).resolve().parents[3] / "recipes"):
            if (folder / f"{spec}.toml").is_file():
                return folder / f"{spec}.toml"
    if path.is_dir():
        raise RidgefillError(f"recipe {spec} is a folder, not a file: pass a .toml file (e.g. "
                             "recipes/quickstart.toml)")
    raise RidgefillError(f"recipe {spec} does not exist: pass a .toml file (e.g. recipes/quickstart.toml)")


def load_recipe(path: str | Path, overrides=()) -> Recipe:
    """Parse the file, apply the overrides and validate everything (no model is loaded); any problem is one line
    naming its key (or its override)."""
    path = Path(path)
    text, raw = read_toml(path)
    return recipe_from(raw, path, text, overrides)


def recipe_from(raw: dict, path: Path, text: str, overrides=(), where: str | None = None) -> Recipe:
    """A recipe from its parsed tables: a file's, or tables built in memory (tune's, `where` naming them in error
    messages instead of `path`, and `text` their record, toml_text). Validated as load_recipe says."""
    source = Source(Path(where) if where else path, apply_overrides(raw, overrides, path))
    settings = top_settings(source, raw)
    settings["name"] = settings["name"] or path.stem
    tables = {step: step_values(source, step, raw[step], settings) for step in steps() if step in raw}
    if not tables:
        raise RidgefillError(f"{path}: no step: add at least one of the tables {_tables(steps())}")
    recipe = Recipe(path, text, settings["name"], settings, tables, tuple(overrides), where)
    check_inputs(recipe)
    preflight(recipe, source)
    return recipe


# --- overrides --------------------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[str | None, str, object]:
    """`KEY=VALUE` or `STEP.OPTION=VALUE` as (step or None, key, value); the value is read as TOML, and a value
    TOML cannot read (a bare word, a path) is the string itself."""
    key, sep, value = text.partition("=")
    step, dot, option = key.strip().partition(".")
    if not sep or not key.strip() or (dot and not (step and option)):
        raise RidgefillError(f"override {text}: expected KEY=VALUE or STEP.OPTION=VALUE, e.g. splits=[15,18] or "
                             "ruler.samples=20")
    return (step, option, toml_value(value.strip())) if dot else (None, step, toml_value(value.strip()))


def apply_overrides(raw: dict, overrides, path: Path) -> dict:
    """Set each override in the parsed recipe; returns where each overridden value came from, by (step, key)."""
    sources = {}
    for text in overrides:
        step, key, value = parse_override(text)
        if step is None and key in steps():
            raise RidgefillError(f"override {text}: [{key}] is a step table: set its options one by one, e.g. "
                                 f"{key}.OPTION=VALUE")
        if step is not None and step not in steps():
            raise RidgefillError(f"override {text}: unknown step{_did_you_mean(step, steps())}; steps are "
                                 f"{_tables(steps())}")
        if step is not None and not isinstance(raw.get(step), dict):
            raise RidgefillError(f"override {text}: {path} has no [{step}] table: add one to the recipe (an empty "
                                 f"[{step}] runs the step with its defaults), then override its options")
        (raw if step is None else raw[step])[key] = value
        sources[(step, key)] = text
    return sources


# --- top-level settings -----------------------------------------------------------------------------------
def top_settings(source: Source, raw: dict) -> dict:
    where = source.path
    for key, value in raw.items():
        if key in TOP or key in steps():
            continue
        if isinstance(value, dict):
            raise RidgefillError(f"{where}: [{key}]: unknown step{_did_you_mean(key, steps())}; steps are "
                                 f"{_tables(steps())}")
        raise RidgefillError(f"{source.at(key)}: unknown key{_did_you_mean(key, TOP)}; top-level keys are "
                             f"{', '.join(TOP)}")
    for step in steps():
        if step in raw and not isinstance(raw[step], dict):
            raise RidgefillError(f"{where}: {step}: expected a table [{step}] of its options, got {_show(raw[step])}")
    settings = {}
    for key, (kind, default) in TOP.items():
        if key not in raw:
            if default is REQUIRED:
                raise RidgefillError(f"{where}: {key}: missing (required)")
            settings[key] = list(default) if isinstance(default, list) else default
            continue
        settings[key] = _top_value(source.at(key), raw[key], kind)
    name = source.path.stem if settings["name"] is None else settings["name"]  # the run folder: runs/<name>
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name):
        where = source.at("name") if settings["name"] is not None else f"{source.path}: name (from the file name)"
        raise RidgefillError(f"{where}: {_show(name)} is not a plain folder name (runs/<name>): use letters, digits, "
                             '. _ - and start with a letter, digit, _ or -, e.g. name = "my-run"')
    for key in ("model", "data"):
        if settings[key] is not None:
            settings[key] = SPECS[key](source.at(key), settings[key], source.base(key))
    for key, low in (("splits", 1), ("tails", 1), ("seeds", 0)):
        if min(settings[key]) < low:
            raise RidgefillError(f"{source.at(key)}: {min(settings[key])} is out of range: use {low} or more")
    if settings["chunk"] < 1 or settings["tolerance"] < 0:
        raise RidgefillError(f"{where}: chunk must be at least 1 and tolerance at least 0")
    settings["device"], settings["dtype"] = resolved_device(source, settings["device"], settings["dtype"])
    return settings


def resolved_device(source: Source, device: str, dtype: str) -> tuple[str, str]:
    """The top-level device and dtype with `auto` resolved for this machine (runtime/device.py), before any task is
    planned or keyed: a run records, and keys its artifacts by, what it runs on. An error names its key."""
    from ridgefill.runtime.device import AUTO, resolve_device  # torch: imported once a recipe is read

    try:
        device = resolve_device(device, AUTO)[0]
    except RidgefillError as exc:
        raise RidgefillError(f"{source.at('device')}: {exc}") from None
    try:
        return resolve_device(device, dtype)
    except RidgefillError as exc:
        raise RidgefillError(f"{source.at('dtype')}: {exc}") from None


def _top_value(where: str, value, kind):
    if kind == "ints":
        values = value if isinstance(value, list) else [value]
        if not values or not all(_is_int(v) for v in values):
            raise RidgefillError(f"{where}: expected an integer or a list of integers, got {_show(value)}")
        return sorted(set(values))
    if kind == "lam":
        if value == "auto" or (_is_number(value) and value > 0):
            return value
        raise RidgefillError(f"{where}: expected \"auto\" or a positive number, got {_show(value)}")
    return _typed(where, value, kind)


# --- step tables ------------------------------------------------------------------------------------------
def step_values(source: Source, step: str, table: dict, settings: dict) -> dict:
    """A step table's values by option field, validated against the command's options, and the top-level value
    of each option that falls back to one and that the table leaves out."""
    cmd = command(step)
    values = {**fallback_values(cmd, settings), **table_values(source, step, cmd, table)}
    check_required(source, step, cmd, values, settings)
    return values


def table_values(source: Source, step: str, cmd: Command, table: dict) -> dict:
    options = cmd.options
    out = {}
    for flag, value in table.items():
        at = source.at(flag, step)
        option = options.get(flag) or options.get(flag.replace("_", "-"))
        if option is not None and (option.top or option.role in WIRED):
            raise RidgefillError(f"{at}: set by {_setter(cmd, option)}, not in a step table: remove it")
        if flag not in options:
            hint = f" (write {option.flag})" if option is not None else _did_you_mean(flag, options)
            raise RidgefillError(f"{at}: unknown option{hint}; [{step}] takes "
                                 f"{', '.join(table_options(cmd)) or 'no options'}")
        out[option.name] = option_value(at, option, value, source.base(flag, step))
    return out


def fallback_values(cmd: Command, settings: dict) -> dict:
    return {o.name: settings[o.fallback] for o in cmd.options.values()
            if o.fallback and settings.get(o.fallback) is not None}


def check_required(source: Source, step: str, cmd: Command, values: dict, settings: dict) -> None:
    """Every required option is set: by the table, a fallback, the top level or (for what it wires) the runner."""
    for o in (o for o in cmd.options.values() if o.required):
        if o.fallback and o.name not in values:
            raise RidgefillError(f"{source.path}: {o.fallback}: missing: [{step}] needs its {o.flag} "
                                 f"({o.help.rstrip('.')}): set the top-level `{o.fallback}` or [{step}].{o.flag}")
        if o.top and settings.get(o.top) is None:
            raise RidgefillError(f"{source.path}: {o.top}: missing: [{step}] needs it ({o.help})")
        if o.name not in values and not (o.role or o.top):
            raise RidgefillError(f"{source.path}: [{step}].{o.flag}: missing (required): {o.help}")


def table_options(cmd: Command) -> list[str]:
    """The options a step table may set: all but those the top level or the runner sets."""
    return [o.flag for o in cmd.options.values() if not o.top and o.role not in WIRED]


def _setter(cmd: Command, option: Option) -> str:
    if option.top:
        return f"the top-level `{option.top}`"
    if option.role == "input":
        return f"the runner (it passes {_made_by(cmd.reads)})"
    if option.role == "output":
        return "the runner (artifacts go in the run folder)"
    if option.role == "restart":
        return "the runner (a step given to --force starts over)"
    return "the runner (it always resumes an interrupted step)"


def option_value(at: str, option: Option, value, base: Path):
    """A table value as the command's option takes it: a TOML list of a comma-separated option as its text, a
    path made absolute (an input file must exist), a data or model spec checked like the top-level key."""
    if option.listed:
        return _list(at, value, option.listed)
    if option.many:
        if not isinstance(value, list):
            raise RidgefillError(f"{at}: expected a list, got {_show(value)}")
        return [option_value(at, _single(option), v, base) for v in value]
    spec = option.fallback or option.flag
    if spec in SPECS:
        return SPECS[spec](at, _typed(at, value, str), base)
    if option.kind is Path:
        path = _local(_typed(at, value, Path), base)
        if option.role != "store" and not path.exists():
            raise RidgefillError(f"{at}: {path} does not exist ({RELATIVE})")
        return path
    return _typed(at, value, option.kind)


def _single(option: Option) -> Option:
    return replace(option, many=False)


def _typed(where: str, value, kind):
    ok = {int: _is_int, float: _is_number, bool: lambda v: isinstance(v, bool)}.get(kind, lambda v: isinstance(v, str))
    if not ok(value):
        raise RidgefillError(f"{where}: expected {KINDS.get(kind, kind.__name__)}, got {_show(value)}")
    return float(value) if kind is float else value


def _list(where: str, value, kind) -> str:
    """A TOML list, as the comma-separated text the command line takes."""
    ok = _is_int if kind is int else (lambda v: isinstance(v, str) and v.strip() and "," not in v)
    if not isinstance(value, list) or not value or not all(ok(v) for v in value):
        raise RidgefillError(f"{where}: expected a list of {'integers' if kind is int else 'strings'}, got "
                             f"{_show(value)}")
    return ",".join(str(v) for v in value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _local(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def data_spec(where: str, value: str, base: Path) -> str:
    """A built-in corpus, an existing file or folder (made absolute), or a Hub dataset id (fetched when used)."""
    from ridgefill.runtime.data import builtin_corpora

    if value in builtin_corpora():
        return value
    path = _local(value, base)
    if path.exists():
        return str(path)
    if value.endswith(FILE_SUFFIXES) or value.startswith((".", "/", "~")) or value.count("/") != 1:
        raise RidgefillError(f"{where}: {path} does not exist ({RELATIVE}); use a file or folder, a Hub dataset id "
                             f"or one of {', '.join(builtin_corpora())}")
    return value


def model_spec(where: str, value: str, base: Path) -> str:
    """An alias, an existing model folder (made absolute), or a Hub id (only resolved when the run starts)."""
    from ridgefill.runtime.models import ALIASES

    if value in ALIASES:
        return value
    path = _local(value, base)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RidgefillError(f"{where}: {path} has no config.json: point it at a Hugging Face model folder")
        return str(path)
    if path.exists() or value.startswith((".", "/", "~")) or value.count("/") != 1:
        raise RidgefillError(f"{where}: {path} does not exist: use a local Hugging Face folder ({RELATIVE}), a Hub "
                             f"id (org/name) or an alias ({', '.join(ALIASES)})")
    return value


# The top-level keys whose values name something to find; a step option of that name (or falling back to it)
# is checked the same way.
SPECS = {"model": model_spec, "data": data_spec}


# --- artifacts and the commands' own checks ---------------------------------------------------------------
def check_inputs(recipe: Recipe) -> None:
    """Every step whose command needs an earlier step's artifact has that step in the recipe."""
    for step in recipe.steps:
        cmd = command(step)
        needed = [o for o in cmd.options.values() if o.role == "input" and o.required]
        maker = producer(cmd.reads)
        if needed and maker not in recipe.steps:
            raise RidgefillError(f"{recipe.named}: [{step}]: needs {_made_by(cmd.reads)}: add {_to_add(recipe, maker)}")


def preflight(recipe: Recipe, source: Source) -> None:
    """Build every task's config, with placeholder paths for what the runner wires, and run its command's own
    checks (those that need no model): for every split, tail and seed, before any work starts."""
    for task in plan(recipe):
        cmd = command(task.step)
        upstream = Path("artifacts") / f"{task.needs}.input" if task.needs else None
        values = task_values(cmd, task, Path("artifacts") / f"{task.label}{cmd.writes or ''}", upstream,
                             Path("artifacts") / "exact", fresh=False)
        config = _checked(recipe, task, lambda: cmd.make(**values))
        _check_wanted_input(recipe, source, task, cmd, config)
        _checked(recipe, task, config.check)


def _checked(recipe: Recipe, task: Task, check):
    """check(), its error prefixed with the recipe and the step (and the tail, when the step takes one)."""
    try:
        return check()
    except RidgefillError as exc:
        tail = f" (tail {task.tail})" if task.tail is not None else ""
        raise RidgefillError(f"{recipe.named}: [{task.step}]{tail}: {exc}") from None


def _check_wanted_input(recipe: Recipe, source: Source, task: Task, cmd: Command, config) -> None:
    """An optional input the options ask for (e.g. the ridge variant wants maps) has its maker in the recipe."""
    wanted = config.wants_input()
    maker = producer(cmd.reads)
    if wanted is None or maker in recipe.steps:
        return
    option, value, instead = wanted
    raise RidgefillError(f"{source.at(option.replace('_', '-'), task.step)}: {value} needs {_made_by(cmd.reads)}: "
                         f"add {_to_add(recipe, maker)}, or {instead}")


def _to_add(recipe: Recipe, maker: str | None) -> str:
    """The tables to add for `maker`'s artifact: it and, before it, the makers of what it needs in turn."""
    if maker is None:
        return "the step that makes it"
    missing = []
    while maker is not None and maker not in recipe.steps and maker not in missing:
        missing.insert(0, maker)
        maker = producer(command(maker).reads)
    return f"a [{missing[0]}] table" if len(missing) == 1 else " and ".join(f"[{m}]" for m in missing) + " tables"


def _made_by(kind: str | None) -> str:
    """e.g. "the maps that [fit] makes"."""
    maker = producer(kind)
    noun = NOUNS.get(kind, kind or "artifact")
    return f"the {noun} that [{maker}] makes" if maker else f"the {noun} that no recipe step makes (a bug: report it)"


# --- message helpers --------------------------------------------------------------------------------------
def _show(value) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _tables(names) -> str:
    return ", ".join(f"[{n}]" for n in names)
