"""The plan of a recipe: one task per artifact, in pipeline order.

The sweep axes are the top-level lists `splits`, `tails` and `seeds`. A step takes an axis when its command has an
option the axis sets (`top="splits"`, ...): one task per value, or all values at once when that option is a list
(`listed`, e.g. calibrate's --split 15,18). A task reads the artifact of the task of the step that `makes` what
its command `reads`, at the same split (tail, seed) where that step takes them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ridgefill.commands import Command, command, steps

AXES = {"splits": ("split", "s"), "tails": ("tail", "t"), "seeds": ("seed", "seed")}  # key: (Task field, label)


@dataclass
class Task:
    step: str
    label: str  # e.g. loss-s18-t256-seed0
    kwargs: dict  # the command's option values the recipe sets (by field), except what the runner wires
    split: int | None = None
    tail: int | None = None
    seed: int | None = None
    needs: str | None = None  # label of the task whose artifact it reads


class Planned(Protocol):
    """What a plan reads of a recipe (pipeline/recipe.Recipe): its top-level settings and its steps' values. A
    protocol, so that recipe.py imports this module and never the other way round."""

    settings: dict
    steps: dict[str, dict]


def plan(recipe: Planned) -> list[Task]:
    tasks: list[Task] = []
    for step, values in recipe.steps.items():
        cmd = command(step)
        fixed = {**top_values(cmd, recipe.settings), **values}
        axes = step_axes(cmd)
        for point in itertools.product(*(recipe.settings[key] for key in axes)):
            at = {AXES[key][0]: value for key, value in zip(axes, point)}
            label = step + "".join(f"-{AXES[key][1]}{value}" for key, value in zip(axes, point))
            task = Task(step, label, {**fixed, **{axes[key]: v for key, v in zip(axes, point)}}, **at)
            task.needs = upstream(cmd, task, tasks)
            tasks.append(task)
    return tasks


def step_axes(cmd: Command) -> dict[str, str]:
    """The axes the step runs once per value of: axis key -> option field, in AXES order."""
    taken = {o.top: o.name for o in cmd.options.values() if o.top in AXES and not o.listed}
    return {key: taken[key] for key in AXES if key in taken}


def top_values(cmd: Command, settings: dict) -> dict:
    """The values of the options the top level sets, except the axes a step runs once per value of: a listed
    option takes the whole list, as comma-separated text."""
    out = {}
    for o in cmd.options.values():
        if not o.top or settings.get(o.top) is None or (o.top in AXES and not o.listed):
            continue
        value = settings[o.top]
        if o.listed:
            value = ",".join(str(v) for v in (value if isinstance(value, list) else [value]))
        out[o.name] = str(value) if o.kind is str else value
    return out


def producer(kind: str | None) -> str | None:
    """The recipe step whose command makes `kind` (e.g. "maps"), None if none does."""
    if kind is None:
        return None
    return next((step for step in steps() if command(step).makes == kind), None)


def upstream(cmd: Command, task: Task, earlier: list[Task]) -> str | None:
    """The label of the task whose artifact `task` reads: the maker's task at the same split, tail and seed
    (where the maker takes them); None when the step reads nothing or its maker is not in the plan."""
    if not any(o.role == "input" for o in cmd.options.values()):
        return None
    maker = producer(cmd.reads)
    fields = [field for field, _ in AXES.values()]
    found = [t.label for t in earlier if t.step == maker
             and all(getattr(t, f) is None or getattr(t, f) == getattr(task, f) for f in fields)]
    return found[0] if len(found) == 1 else None


def task_values(cmd: Command, task: Task, out: Path, upstream_artifact: Path | None, store: Path,
                fresh: bool) -> dict:
    """Every option value of a task's command: the recipe's, and those the runner wires by role: the artifact it
    reads, the one it writes, resume (unless forced afresh) and the exact-results store (unless the table names
    one)."""
    values = dict(task.kwargs)
    for o in cmd.options.values():
        if o.role == "input" and upstream_artifact is not None:
            values[o.name] = upstream_artifact
        elif o.role == "output":
            values[o.name] = out
        elif o.role == "resume":
            values[o.name] = not fresh
        elif o.role == "restart":  # a forced step starts over, whatever an earlier run left
            values[o.name] = fresh
        elif o.role == "store" and values.get(o.name) is None:
            values[o.name] = store
    return values
