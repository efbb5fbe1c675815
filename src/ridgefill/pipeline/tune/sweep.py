"""A tune's sweep: a recipe's tasks run split by split into one run folder, each split judged once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ridgefill.pipeline.frontier import FlopModel, Point, frontier
from ridgefill.pipeline.tune.verdict import PASS, verdict
from ridgefill.runtime.console import note
from ridgefill.runtime.models import ModelIdentity

if TYPE_CHECKING:
    from ridgefill.pipeline.recipe import Recipe


@dataclass
class Sweep:
    """A recipe's tasks, run split by split into one run folder: the measured splits' tasks (and the shared
    calibration) each time, so manifest.json lists everything measured so far and cached tasks cost nothing.
    Each split is judged once, on what `judged` names (verdict()); `reuse`: a run folder whose artifacts of the
    same name (the same key: the same inputs) are linked instead of computed."""

    recipe: "Recipe"
    run_dir: Path
    facts: ModelIdentity
    flops: FlopModel
    variants: list[str]
    tolerance: float
    max_gap: float
    judged: tuple[str, ...] = ("ruler",)
    reuse: Path | None = None
    measured: list[int] = field(default_factory=list)
    verdicts: dict = field(default_factory=dict)  # (variant, split) -> PASS or why not

    def judge(self, split: int) -> dict[str, bool]:
        from ridgefill.pipeline.manifest import Manifest
        from ridgefill.pipeline.plan import plan
        from ridgefill.pipeline.run import run_tasks

        if split not in self.measured:
            note(f"tune: {'checking' if 'ruler' not in self.judged else 'measuring'} split {split}"
                 f"{'' if 'ruler' in self.judged else ' (' + ', '.join(self.variants) + ' NLL)'}")
            self.measured.append(split)
            tasks = [t for t in plan(self.recipe) if t.split is None or t.split in self.measured]
            manifest = Manifest(self.run_dir, self.recipe, self.facts.info)
            run_tasks(tasks, self.run_dir, self.facts.info["weights_hash"], (), manifest, reuse=self.reuse)
            points = {p.variant: p for p in self.frontier().points if p.split == split}
            for v in self.variants:
                self.verdicts[(v, split)] = verdict(points.get(v), self.tolerance, self.max_gap, self.judged)
        return {v: self.verdicts[(v, split)] == PASS for v in self.variants}

    def results(self) -> tuple[dict, list]:
        from ridgefill.report.results import collect

        return collect(self.run_dir)

    def speedup(self, variant: str, split: int) -> float | None:
        """The FLOP-limit speedup of `variant` at `split`, at the recipe's tail."""
        return self.flops.speedup(variant, split, self.recipe.settings["tails"][0])

    def frontier(self):
        _, results = self.results()
        return frontier([r for r in results if r.command == "ruler"], [r for r in results if r.command == "loss"],
                        [], self.tolerance, self.flops)


def merged_points(sweep: Sweep, checks: dict[str, Sweep]) -> list[Point]:
    """The search's points (RULER, FLOP-limit speedup at the serving tail) with the NLL of each checked split."""
    checked = {(p.variant, p.split): p for check in checks.values() for p in check.frontier().points}
    out = []
    for p in sweep.frontier().points:
        nll = checked.get((p.variant, p.split))
        out.append(p if nll is None else replace(p, distant_nll=nll.distant_nll,
                                                 distant_nll_exact=nll.distant_nll_exact,
                                                 nll_metric=nll.nll_metric))
    return out
