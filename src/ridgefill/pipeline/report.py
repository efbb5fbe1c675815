"""`ridgefill report RUN_DIR`: read a run folder's results (report/results.py), decide the frontier and the useful
split (pipeline/frontier.py) and render report.md and its plots (report/write.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ridgefill.commands import REQUIRED, Command, Config, option
from ridgefill.errors import RidgefillError
from ridgefill.pipeline.frontier import flop_model, frontier
from ridgefill.report.results import collect
from ridgefill.report.write import render


def write_report(run_dir: str | Path, tolerance: float | None = None) -> Path:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.png; returns the report's path. tolerance: retrieval points
    below exact that still count as equal quality for the useful split (None: the recipe's, else 5)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RidgefillError(f"{run_dir} is not a folder: pass a run folder (from ridgefill run)")
    manifest, results = collect(run_dir)
    if not results:
        raise RidgefillError(f"{run_dir} holds no ridgefill result documents: run a recipe (ridgefill run) or a "
                             "command that writes JSON into it first")
    if tolerance is None:
        tolerance = ((manifest or {}).get("settings") or {}).get("tolerance", 5.0)
    of = {name: [r for r in results if r.command == name] for name in ("ruler", "loss", "bench-ttft")}
    found = frontier(of["ruler"], of["loss"], of["bench-ttft"], tolerance, flop_model(manifest, results))
    return render(run_dir, manifest, results, found, tolerance)


@dataclass
class ReportConfig(Config):
    run_dir: Path = option(REQUIRED, "Run folder (from `ridgefill run`) or any folder of result JSONs.",
                           positional=True)
    tolerance: float | None = option(None, "Retrieval points below exact that still count as equal quality for "
                                     "the useful split (default: the recipe's, else 5).")

    def check(self) -> None:
        if self.tolerance is not None and not self.tolerance >= 0:
            raise RidgefillError(f"--tolerance {self.tolerance} must be 0 or more (retrieval points below exact)")


def run(config: ReportConfig) -> Path:
    path = write_report(config.run_dir, config.tolerance)
    print(path)
    return path


COMMAND = Command("report", ReportConfig, run)
