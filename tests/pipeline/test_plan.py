"""pipeline/plan.py: the plan reads a recipe's settings and steps and imports nothing of pipeline/recipe.py (which
imports it), not even for type checking: the pair points one way."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from ridgefill.pipeline import plan as plan_module
from ridgefill.pipeline.plan import plan
from ridgefill.pipeline.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (TYPE_CHECKING blocks and functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_plan_imports_nothing_of_recipe():
    imports = imported_modules(Path(plan_module.__file__))
    assert not {m for m in imports if m.startswith("ridgefill.pipeline.recipe")}, imports
    assert "ridgefill.pipeline.plan" in imported_modules(ROOT / "src" / "ridgefill" / "pipeline" / "recipe.py")


def test_plan_reads_only_the_settings_and_steps():
    recipe = load_recipe(ROOT / "recipes" / "smollm2-methodology.toml")
    bare = SimpleNamespace(settings=recipe.settings, steps=recipe.steps)
    assert [(t.label, t.kwargs, t.needs) for t in plan(bare)] == [(t.label, t.kwargs, t.needs) for t in plan(recipe)]
