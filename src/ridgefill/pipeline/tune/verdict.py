"""How `ridgefill tune` judges: a point's verdict against the bounds, the faster of the variants' choices, and
whether the NLL check rests on enough distant-context tokens to judge."""

from __future__ import annotations

from ridgefill.pipeline.frontier import Point

PASS = "pass"
MIN_DISTANT_TOKENS = 300  # fewer give no interval that separates fills (docs/quality.md, issue #13)


def verdict(point: Point | None, tolerance: float, max_gap: float, judged=("ruler", "nll")) -> str:
    """PASS, or why the point fails, on what `judged` names: the filled-region RULER score within `tolerance`
    points of exact's, the distant-context NLL (tail NLL where none was found) within `max_gap` nats."""
    if "ruler" in judged:
        if point is None or point.retrieval_drop is None:
            return "no RULER score"
        if point.retrieval_drop > tolerance:
            return f"RULER {-point.retrieval_drop:+.1f} points"
    if "nll" in judged:
        if point is None or point.distant_gap is None:
            return "no NLL"
        if point.distant_gap > max_gap:
            return f"{point.nll_metric or 'distant'} NLL {point.distant_gap:+.3f} nats"
    return PASS


def best_choice(points: list[Point], chosen: dict[str, int | None]) -> Point | None:
    """Of each variant's chosen split, the point with the highest FLOP-limit speedup (the lower split, then
    identity fill, where it is not counted)."""
    found = [p for p in points if chosen.get(p.variant) == p.split]
    if not found:
        return None
    return max(found, key=lambda p: (p.flop_speedup or 0.0, -p.split, p.variant == "identity"))


def distant_warning(results: list) -> str | None:
    """A line saying that the NLL verdicts rest on too few distant-context tokens to judge, or None. The tokens
    are the exact model's, the same at every split, so any loss result counts them."""
    from ridgefill.runtime.stats import describe_spread

    spread = next((r.doc.get("distant_spread") for r in results if r.command == "loss"), None)
    if not spread or spread["tokens"] >= MIN_DISTANT_TOKENS:
        return None
    more = "more --passages, a longer --context or a longer --nll-tail"
    if not spread["tokens"]:
        return (f"tune: no distant-context token in {spread['passages']} passages: the NLL check was judged on the "
                f"tail NLL; {more} give a distant-context check (docs/tune.md)")
    return (f"tune: the NLL check rests on {describe_spread(spread)}: fewer than {MIN_DISTANT_TOKENS} cannot "
            f"separate fills within the bound, so treat it as a rough screen; {more} sharpen it (docs/tune.md)")
