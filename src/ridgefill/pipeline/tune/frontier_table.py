"""The frontier table `ridgefill tune` prints: per window, split and variant the FLOP-limit speedup beside the
quality, the verdicts and which point was chosen and served."""

from __future__ import annotations

from ridgefill.pipeline.frontier import Point
from ridgefill.pipeline.tune.windows import WindowRun
from ridgefill.runtime.console import table


def print_frontier(runs: list[WindowRun], served: tuple[WindowRun, Point] | None, tail: int) -> None:
    rows = [frontier_row(r, p, served) for r in runs for p in sorted(r.points, key=lambda p: (-p.split, p.variant))]
    sweep = runs[0].sweep
    length = next((p.length for r in runs for p in r.points if p.length), sweep.flops.length)
    nll = f", NLL within {sweep.max_gap:g} nats" if runs[0].checks else ""
    table(f"tune: FLOP-limit speedup at {length} tokens vs quality (tail {tail}; RULER within "
          f"{sweep.tolerance:g} points{nll} of exact)",
          ["window", "split", "variant", "FLOP-limit speedup", "RULER", "exact RULER", "Δ RULER", "Δ NLL (nats)",
           "RULER verdict", "NLL check", "chosen"], rows)


def frontier_row(run: WindowRun, p: Point, served: tuple[WindowRun, Point] | None) -> list:
    """A point's row of the frontier table; chosen: `served`, `yes` (its window's choice) or `RULER's` (the
    search's choice the check moved up from)."""
    key = (p.variant, p.split)
    check = run.checks[p.variant].verdicts.get(key, "") if p.variant in run.checks else ""
    is_served = served is not None and served[0] is run and (served[1].variant, served[1].split) == key
    chosen = "served" if is_served else "yes" if run.chosen.get(p.variant) == p.split else \
        "RULER's" if run.searched.get(p.variant) == p.split else ""
    return [run.window or "full", p.split, p.variant, p.flop_speedup, p.retrieval, p.retrieval_exact,
            None if p.retrieval_drop is None else p.retrieval - p.retrieval_exact, p.distant_gap,
            run.sweep.verdicts.get(key, ""), check, chosen]
