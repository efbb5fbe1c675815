"""The searches over candidate splits and the NLL check's step up (pipeline/search.py), on stubbed quality tables."""

from __future__ import annotations

import pytest

from ridgefill.pipeline.search import bisect, descend, search, step_up


class Table:
    """A judge from a table: split -> variant -> passes; records the splits it was asked about."""

    def __init__(self, passes: dict[int, dict[str, bool]]):
        self.passes, self.asked = passes, []

    def __call__(self, split: int) -> dict[str, bool]:
        self.asked.append(split)
        return self.passes[split]


def thresholds(splits, **lowest) -> Table:
    """Monotone quality: a variant passes at and above its lowest passing split (None: nowhere)."""
    return Table({s: {v: low is not None and s >= low for v, low in lowest.items()} for s in splits})


SPLITS = list(range(10, 21))


def test_descend_chooses_the_lowest_passing_split_and_stops_when_every_variant_failed():
    judge = thresholds(SPLITS, identity=16, ridge=13)
    assert descend(SPLITS, judge, ["identity", "ridge"]) == {"identity": 16, "ridge": 13}
    assert judge.asked == list(range(20, 11, -1))  # 12 is the first split where both fail: nothing below it runs


def test_bisect_finds_the_same_splits_with_fewer_measurements():
    judge = thresholds(SPLITS, identity=16, ridge=13)
    assert bisect(SPLITS, judge, ["identity", "ridge"]) == {"identity": 16, "ridge": 13}
    assert judge.asked[0] == 20 and len(judge.asked) < 9 and len(set(judge.asked)) == len(judge.asked)
    assert {15, 16, 12, 13} <= set(judge.asked)  # each answer certified: it passed, the split below failed


@pytest.mark.parametrize("candidates", [SPLITS, [14, 16, 18], [7]])
def test_bisect_agrees_with_descend_on_every_monotone_table(candidates):
    options = [None, *candidates]
    for identity in options:
        for ridge in options:
            expected = descend(candidates, thresholds(candidates, identity=identity, ridge=ridge),
                               ["identity", "ridge"])
            found = bisect(candidates, thresholds(candidates, identity=identity, ridge=ridge), ["identity", "ridge"])
            assert found == expected == {"identity": identity, "ridge": ridge}


def test_a_noisy_dip_stops_the_descent_and_all_measures_every_split():
    passes = {s: {"ridge": s != 18} for s in SPLITS}  # ridge fails at 18 only
    judge = Table(passes)
    assert descend(SPLITS, judge, ["ridge"]) == {"ridge": 19} and judge.asked == [20, 19, 18]
    judge = Table(passes)
    assert search("all", SPLITS, judge, ["ridge"]) == {"ridge": 19} and judge.asked == SPLITS[::-1]


def test_nothing_passes_at_the_top():
    judge = thresholds(SPLITS, identity=None, ridge=None)
    assert bisect(SPLITS, judge, ["identity", "ridge"]) == {"identity": None, "ridge": None}
    assert judge.asked == [20]


def speed(variant: str, split: int) -> float:
    """A FLOP-limit speedup that falls with the split; identity fill a little faster than ridge at one split,
    slower than ridge one split lower."""
    return 3.0 - 0.1 * split + (0.02 if variant == "identity" else 0.0)


def test_the_check_walks_up_fastest_first_and_serves_the_first_pass():
    ruler = thresholds(SPLITS, identity=14, ridge=12)
    checks = {"identity": thresholds(SPLITS, identity=15), "ridge": thresholds(SPLITS, ridge=16)}
    chosen = step_up(SPLITS, {"identity": 14, "ridge": 12}, ruler, checks, speed)
    assert chosen == {"identity": 15, "ridge": None}  # identity 15 is served: nothing slower is checked
    assert checks["ridge"].asked == [12, 13, 14] and checks["identity"].asked == [14, 15]
    assert ruler.asked == [12, 13, 14, 14, 15]  # RULER first for every (variant, split) the check visits


def test_the_check_order_follows_the_speedup():
    ruler = thresholds(SPLITS, identity=14, ridge=14)
    checks = {"identity": thresholds(SPLITS, identity=17), "ridge": thresholds(SPLITS, ridge=16)}
    assert step_up(SPLITS, {"identity": 14, "ridge": 14}, ruler, checks, speed) == {"identity": None, "ridge": 16}
    assert checks["identity"].asked == [14, 15, 16] and checks["ridge"].asked == [14, 15, 16]  # id 16 before ridge 16
    no_count = {"identity": thresholds(SPLITS, identity=14), "ridge": thresholds(SPLITS, ridge=14)}
    assert step_up(SPLITS, {"identity": 14, "ridge": 14}, ruler, no_count, lambda v, s: None) == \
        {"identity": 14, "ridge": None}  # no FLOP count (a hybrid model): the lower split, identity first


def test_the_check_skips_a_split_whose_ruler_fails_and_may_find_none():
    ruler = Table({s: {"ridge": s != 15} for s in SPLITS})  # a noisy dip the search did not see
    checks = {"ridge": thresholds(SPLITS, ridge=15)}
    assert step_up(SPLITS, {"ridge": 14}, ruler, checks, speed) == {"ridge": 16} and checks["ridge"].asked == [14, 16]
    checks = {"ridge": thresholds(SPLITS, ridge=None)}
    assert step_up(SPLITS, {"ridge": 19}, ruler, checks, speed) == {"ridge": None} and checks["ridge"].asked == [19, 20]
    assert step_up(SPLITS, {"ridge": None}, ruler, checks, speed) == {"ridge": None}  # the search chose none
