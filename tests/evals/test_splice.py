"""`ridgefill splice`: prefix caches, splice invariants (nothing = filled, everything = exact, key-scale +
key-direction = keys), state swaps on hybrid models, option parsing, and the command end to end."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from tiny_models import A, L, random_ids, tiny_model
from ridgefill.cli import app
from ridgefill.torchfill import Runner, FillPlan, IdentityFiller, adapter_for
from ridgefill.errors import RidgefillError
from ridgefill.backends.torchfill import TorchfillBackend
from ridgefill.evals.scoring import continuation_nll, tail_nll
from ridgefill.evals.splice import layer_ranges, parse_layer_ranges, parse_swaps, prefix_pair, splice, spliced_keys
from ridgefill.runtime.stats import describe_spread, distant_spread

N, TAIL, SPLIT, KEEP = 40, 10, 2, (0, 7)
TOL = 1e-4


def setup(model, split=SPLIT):
    runner = Runner(adapter_for(model), chunk=16)
    ids = random_ids(N)
    plan = FillPlan(IdentityFiller(split, runner.n_layers), TAIL, KEEP)
    pair = prefix_pair(runner, ids[:, : N - TAIL], plan, capacity=N)
    return runner, ids, plan, pair


def scores(runner, ids, cache):
    return continuation_nll(runner, cache, ids[:, N - TAIL :])[0]


def gap(a, b):
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def dense():
    return setup(tiny_model("llama"))


def test_prefix_caches_match_one_call_prefills(dense):
    runner, ids, plan, pair = dense
    P = N - TAIL
    one_call = runner.prefill(ids, fill=plan).cache
    exact = runner.prefill(ids).cache
    assert pair.rows.tolist() == [r >= 1 for r in range(P)]  # keep row 7 follows filled rows: it differs too
    for layer in range(runner.n_layers):
        assert gap(pair.filled[layer].keys, one_call[layer].keys[:, :, :P]) <= 1e-5
        assert gap(pair.filled[layer].values, one_call[layer].values[:, :, :P]) <= 1e-5
        assert gap(pair.exact[layer].keys, exact[layer].keys[:, :, :P]) <= 1e-5
    assert gap(pair.filled[SPLIT + 1].keys, pair.exact[SPLIT + 1].keys) > 1e-3  # the fill changed something


def test_swapping_nothing_is_the_filled_prefill_and_everything_is_exact(dense):
    runner, ids, plan, pair = dense
    filled, exact = (tail_nll(TorchfillBackend.over(runner, {"filled": plan, "exact": None}), name, ids, TAIL)[0]
                     for name in ("filled", "exact"))
    assert gap(filled, exact) > 1e-3
    assert gap(scores(runner, ids, splice(pair, frozenset(), (SPLIT, 5))), filled) <= TOL
    assert gap(scores(runner, ids, splice(pair, frozenset({"keys", "values"}), (SPLIT, 5))), exact) <= TOL
    # below the split the caches agree: a swap there changes nothing
    assert gap(scores(runner, ids, splice(pair, frozenset({"keys", "values"}), (0, SPLIT))), filled) <= TOL
    # one component alone is neither
    keys_only = scores(runner, ids, splice(pair, frozenset({"keys"}), (SPLIT, 5)))
    assert gap(keys_only, filled) > 1e-4 and gap(keys_only, exact) > 1e-4


def test_swaps_touch_only_filled_rows_of_the_range(dense):
    runner, ids, plan, pair = dense
    out = splice(pair, frozenset({"keys", "values"}), (4, 4))
    rows = pair.rows
    for layer in range(runner.n_layers):
        source = pair.exact if layer == 4 else pair.filled
        assert torch.equal(out[layer].keys[:, :, rows], source[layer].keys[:, :, rows])
        assert torch.equal(out[layer].values[:, :, ~rows], pair.filled[layer].values[:, :, ~rows])
    assert out.length == pair.filled.length and pair.filled[4].keys is not out[4].keys


def test_key_scale_and_direction_decompose_keys(dense):
    runner, ids, plan, pair = dense
    filled, exact = pair.filled[4].keys, pair.exact[4].keys
    scale = spliced_keys(filled, exact, frozenset({"key-scale"}))
    direction = spliced_keys(filled, exact, frozenset({"key-direction"}))
    both = spliced_keys(filled, exact, frozenset({"key-scale", "key-direction"}))
    assert gap(both, exact) <= 1e-5
    assert gap(scale.norm(dim=-1), exact.norm(dim=-1)) <= 1e-4
    assert gap(scale / scale.norm(dim=-1, keepdim=True), filled / filled.norm(dim=-1, keepdim=True)) <= 1e-5
    assert gap(direction.norm(dim=-1), filled.norm(dim=-1)) <= 1e-4
    assert gap(scale, filled) > 1e-3 and gap(direction, filled) > 1e-3
    combined = scores(runner, ids, splice(pair, frozenset({"key-scale", "key-direction"}), (SPLIT, 5)))
    keys = scores(runner, ids, splice(pair, frozenset({"keys"}), (SPLIT, 5)))
    assert gap(combined, keys) <= TOL


def test_state_swap_on_a_hybrid_model():
    runner, ids, plan, pair = setup(tiny_model("qwen3_5", layer_types=[L, A, L, A]), split=1)
    filled, exact = (tail_nll(TorchfillBackend.over(runner, {"filled": plan, "exact": None}), name, ids, TAIL)[0]
                     for name in ("filled", "exact"))
    assert gap(scores(runner, ids, splice(pair, frozenset(), (1, 3))), filled) <= TOL
    assert gap(scores(runner, ids, splice(pair, frozenset({"keys", "values", "state"}), (1, 3))), exact) <= TOL
    state = splice(pair, frozenset({"state"}), (1, 3))
    assert torch.equal(state[2].recurrent, pair.exact[2].recurrent) and torch.equal(state[2].conv, pair.exact[2].conv)
    assert gap(state[2].recurrent, pair.filled[2].recurrent) > 1e-3
    assert torch.equal(state[1].keys, pair.filled[1].keys) and torch.equal(state[0].recurrent, pair.filled[0].recurrent)
    state_only = scores(runner, ids, state)
    assert gap(state_only, filled) > 1e-4 and gap(state_only, exact) > 1e-4


def test_option_parsing():
    assert parse_layer_ranges("16-29, 20-29,25") == [(16, 29), (20, 29), (25, 25)]
    assert parse_swaps("keys,key-scale+key-direction,keys") == [frozenset({"keys"}),
                                                               frozenset({"key-scale", "key-direction"})]
    assert layer_ranges(None, False, 18, 30) == [(18, 29)]
    assert layer_ranges([(20, 29)], True, 18, 30) == [(20, 29), (18, 20), (21, 23), (24, 26), (27, 29)]
    for bad in ("16-", "a-b", "29-16", ""):
        with pytest.raises(RidgefillError, match="not a layer or an increasing range"):
            parse_layer_ranges(bad)
    with pytest.raises(RidgefillError, match="outside the filled range 18-29"):
        layer_ranges([(10, 20)], False, 18, 30)
    with pytest.raises(RidgefillError, match="'queries' is not a component"):
        parse_swaps("keys,queries")


def test_splice_command_end_to_end(tiny_checkpoint, long_docs, tmp_path):
    out = tmp_path / "splice.json"
    r = CliRunner().invoke(app, ["splice", "--model", str(tiny_checkpoint), "--split", "3", "--tail", "32",
                                 "--swap", "keys,keys+values", "--layers", "3-5", "--by-quarter", "--data", str(long_docs),
                                 "--context", "256", "--short", "48", "--samples", "2", "--alpha", "0", "--beta",
                                 "100", "--needles", "1", "--max-new-tokens", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["command"] == "splice" and doc["fill"] == "identity" and doc["split"] == 3
    assert doc["layer_ranges"] == [[3, 5], [3, 3], [4, 4], [5, 5]] and doc["swaps"] == ["keys", "keys+values"]
    assert doc["variants"][:2] == ["exact", "identity"] and "keys+values@4-4" in doc["variants"]
    res = doc["results"]
    assert len(res["exact"]["per_needle"]) == 1 and 0 <= res["exact"]["retrieval"] <= 100
    assert res["keys+values@3-5"]["tail_nll"] == pytest.approx(res["exact"]["tail_nll"], abs=1e-5)
    assert res["keys+values@3-5"]["per_needle"] == res["exact"]["per_needle"]
    assert res["keys+values@3-5"]["gap_closed_tail"] == pytest.approx(1.0, abs=1e-3)
    assert res["keys+values@3-3"]["tail_nll"] == pytest.approx(res["identity"]["tail_nll"], abs=1e-5)  # layer S
    iv = doc["intervals"]["keys@3-5"]
    assert {"tail_nll_nats", "gap_closed_tail", "gap_closed_distant"} <= set(iv)
    assert res["exact"]["distant_tokens"] > 0
    counts = res["exact"]["per_passage"]["distant_tokens"]
    assert doc["distant_spread"] == distant_spread(counts) and doc["distant_spread"]["passages"] == 2
    assert all(res[name]["per_passage"]["distant_tokens"] == counts for name in res)  # marked once, by exact
    assert describe_spread(doc["distant_spread"]) in " ".join(r.output.split())


def test_bad_layers_exit_with_one_line(tiny_checkpoint, long_docs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ridgefill", "splice", "--model", str(tiny_checkpoint), "--split", "3",
                        "--data", str(long_docs), "--layers", "3-x", "--out", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--layers '3-x'" in r.stderr
