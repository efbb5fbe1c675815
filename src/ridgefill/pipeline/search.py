"""Which split each fill variant serves at: the searches `ridgefill tune` runs over its candidate splits, on a
`judge` that measures a split and says which variants pass there (pipeline/tune/ gives it), and the NLL check's
step up from their choices. Quality falls as the split moves down, so each variant's passing splits are, up to
noise, the ones above a threshold.

- bisect (default): measure the highest candidate, then halve each variant's open interval between its lowest
  passing and highest failing split; each measurement judges both variants. About 1 + 2·log2(n) of n candidates,
  and the answer is certified locally: the chosen split passed and the candidate below it failed (or it is the
  lowest candidate);
- descend: from the highest candidate down, one by one, until every variant has failed once: the chosen split has
  every higher candidate passing too (robust to a noisy dip, slower);
- all: every candidate (the full frontier table), chosen as in descend.
"""

from __future__ import annotations

from typing import Callable

SEARCHES = ("bisect", "descend", "all")
Judge = Callable[[int], dict[str, bool]]  # split -> variant -> passes


# --- search -------------------------------------------------------------------------------------------------
def bisect(candidates: list[int], judge: Judge, variants: list[str]) -> dict[str, int | None]:
    """Per variant the lowest passing candidate, assuming quality falls as the split goes down: the highest
    candidate first, then the midpoint of the widest open interval (lowest known pass, highest known failure
    below it); every measurement narrows every variant's interval."""
    order = sorted(candidates)
    passed = judge(order[-1])
    lowest_pass = {v: len(order) - 1 for v in variants if passed[v]}
    highest_fail = {v: -1 for v in lowest_pass}  # -1: no failure known below (the lowest candidate may pass)
    while True:
        gaps = {v: lowest_pass[v] - highest_fail[v] for v in lowest_pass}
        wide = [v for v in lowest_pass if gaps[v] > 1]
        if not wide:
            break
        widest = max(wide, key=lambda v: gaps[v])
        mid = (lowest_pass[widest] + highest_fail[widest]) // 2
        passed = judge(order[mid])
        for v in lowest_pass:
            if highest_fail[v] < mid < lowest_pass[v]:
                (lowest_pass if passed[v] else highest_fail)[v] = mid
    return {v: order[lowest_pass[v]] if v in lowest_pass else None for v in variants}


def descend(candidates: list[int], judge: Judge, variants: list[str], every: bool = False) -> dict[str, int | None]:
    """Per variant the lowest candidate above which every candidate passes: from the highest down, stopping when
    every variant has failed once (every=True: measure every candidate anyway)."""
    chosen: dict[str, int | None] = {v: None for v in variants}
    open_ = set(variants)
    for split in sorted(candidates, reverse=True):
        if not open_ and not every:
            break
        passed = judge(split)
        for v in [v for v in variants if v in open_]:
            if passed[v]:
                chosen[v] = split
            else:
                open_.discard(v)
    return chosen


def search(mode: str, candidates: list[int], judge: Judge, variants: list[str]) -> dict[str, int | None]:
    if mode == "bisect":
        return bisect(candidates, judge, variants)
    return descend(candidates, judge, variants, every=mode == "all")


def step_up(candidates: list[int], chosen: dict[str, int | None], ruler: Judge, checks: dict[str, Judge],
            speed: Callable[[str, int], float | None]) -> dict[str, int | None]:
    """The NLL check of the search's choices, fastest first: every (variant, split) at or above the variant's
    RULER choice, in order of FLOP-limit speedup `speed` (without one: the lower split, identity first), is
    asked RULER (again: measured where the search skipped it), then its NLL check; the first that passes both
    is the one served and nothing slower is checked. Returns per variant the split that passed (None for
    every variant but that one's)."""
    def rank(pair: tuple[str, int]):
        v, split = pair
        return (speed(v, split) or 0.0, -split, v == "identity")

    pairs = sorted(((v, split) for v, low in chosen.items() if low is not None for split in candidates
                    if split >= low), key=rank, reverse=True)
    found: dict[str, int | None] = {v: None for v in chosen}
    for v, split in pairs:
        if ruler(split)[v] and checks[v](split)[v]:
            found[v] = split
            break
    return found


