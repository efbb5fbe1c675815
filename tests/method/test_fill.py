"""The one fill-settings type (method/fill.py): its checks, the runner's plans it gives, the vLLM plugin's environment
(there and back), the fill part of a serving config (there and back, the maps pinned by sha256), and the plans a
measurement runs side by side."""

from __future__ import annotations

import json
import math

import pytest

from ridgefill.errors import RidgefillError
from ridgefill.method.fill import FillOptions, FillSettings, SERVING_KIND, load_serving, parse_variants, variant_plans
from ridgefill.method.fill_fields import ENV
from ridgefill.backends.vllm.fill import V2_RUNNER, fill_env, fill_from_env, pin
from ridgefill.method.maps import save_maps
from ridgefill.runtime.paths import file_sha256
from ridgefill.runtime.session import open_session


@pytest.fixture(scope="module")
def session_and_maps(tiny_checkpoint, tmp_path_factory):
    session = open_session(str(tiny_checkpoint))
    maps = tmp_path_factory.mktemp("maps") / "maps-s3.safetensors"
    save_maps(maps, 3, session.runner.n_layers, [], {"model": session.loaded.info()}, "identity")
    return session, maps


@pytest.mark.parametrize("kwargs, match", [
    ({"variant": "exact", "split": 3}, "unknown fill variant 'exact'"),
    ({"variant": "ridge", "split": 3}, "the ridge variant needs --maps"),
    ({"variant": "identity"}, "identity fill needs --split"),
    ({"variant": "identity", "split": 3, "tail": 0}, "--tail 0 must be an integer of at least 1"),
    ({"variant": "identity", "split": 3, "tail": True}, "--tail True"),
    ({"variant": "identity", "split": 3, "keep_first": -1}, "--keep-first -1"),
    ({"variant": "identity", "split": 3, "outlier_factor": math.nan}, "--outlier-factor nan"),
    ({"variant": "identity", "split": 3, "outlier_factor": math.inf}, "--outlier-factor inf"),
    ({"variant": "identity", "split": 3, "outlier_factor": -1.0}, "--outlier-factor -1 "),
    ({"variant": "identity", "split": 0}, "--split 0"),
])
def test_bad_settings_are_one_line(kwargs, match):
    with pytest.raises(RidgefillError, match=match) as caught:
        FillSettings(**kwargs)
    assert "\n" not in str(caught.value)


def test_the_plan_is_the_settings_on_the_model(session_and_maps):
    session, maps = session_and_maps
    plan, meta = FillSettings("ridge", None, maps, tail=8, keep_first=2, outlier_factor=5.0).plan(session, (10,))
    assert meta["split"] == plan.split == 3 and plan.tail == 8 and plan.keep_rows == (10,) and plan.keep_first == 2
    assert plan.outlier_factor == 5.0
    plan, meta = FillSettings("identity", 2).plan(session)
    assert meta is None and plan.split == 2 and plan.keep_rows == () and plan.keep_first == 1
    with pytest.raises(RidgefillError, match="split 3, not 2"):
        FillSettings("ridge", 2, maps).plan(session)
    with pytest.raises(RidgefillError, match="changed since it was checked"):
        FillSettings("ridge", None, maps, maps_sha256="0" * 64).plan(session)


def test_the_vllm_environment_there_and_back(session_and_maps, tmp_path):
    session, maps = session_and_maps
    pinned = pin(FillSettings("identity", 4, tail=12, keep_first=0, outlier_factor=0.0), session.runner.n_layers,
                 session.loaded.info(), tmp_path)
    assert pinned.maps.parent == tmp_path and pinned.split == 4 and pinned.maps_sha256 == file_sha256(pinned.maps)
    env = fill_env(pinned)
    assert env[ENV["tail"]] == "12" and env[ENV["keep_first"]] == "0" and env[V2_RUNNER] == "0"
    assert env[ENV["maps_sha256"]] == pinned.maps_sha256
    assert fill_from_env(env) == pinned  # identity maps serve identity fill
    assert fill_from_env({}) is None
    with pytest.raises(RidgefillError, match="RIDGEFILL_TAIL='x' is not an integer"):
        fill_from_env({**env, ENV["tail"]: "x"})
    with pytest.raises(RidgefillError, match="RIDGEFILL_TAIL=0|--tail 0"):
        fill_from_env({**env, ENV["tail"]: "0"})
    with pytest.raises(RidgefillError, match=r"pin the settings \(backends/vllm/fill.pin\) first"):
        fill_env(FillSettings("identity", 4))


def serving_doc(fill: FillSettings, weights: str, **changes) -> dict:
    return {"kind": SERVING_KIND, "version": 1, "model": {"weights_hash": weights}, **fill.to_serving(), **changes}


def test_a_serving_config_there_and_back_with_its_maps_pinned(session_and_maps, tmp_path):
    session, maps = session_and_maps
    weights = session.loaded.fingerprint
    ridge = FillSettings("ridge", 3, maps, tail=16, keep_first=1, outlier_factor=7.5)
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(serving_doc(ridge, weights)))
    tuned = load_serving(path)
    assert tuned.fill == ridge.__class__(**{**ridge.__dict__, "maps_sha256": file_sha256(maps)})
    tuned.check_model(weights, path)
    with pytest.raises(RidgefillError, match="tuned for another model"):
        tuned.check_model("0" * 16, path)
    # tune's earlier form, the maps' first 16 hex digits as `hash`, is a prefix: refused (rerun tune), never matched
    path.write_text(json.dumps(serving_doc(ridge, weights, maps={"path": str(maps), "hash": file_sha256(maps)[:16]})))
    with pytest.raises(RidgefillError, match=r"its maps' sha256 None is not a whole sha256 .*: rerun `ridgefill tune`"):
        load_serving(path)
    # a relative path is the config's folder's
    (tmp_path / "m.safetensors").write_bytes(maps.read_bytes())
    path.write_text(json.dumps(serving_doc(ridge, weights, maps={"path": "m.safetensors",
                                                                 "sha256": file_sha256(maps)})))
    assert load_serving(path).fill.maps == tmp_path / "m.safetensors"
    identity = FillSettings("identity", 5, tail=9)
    path.write_text(json.dumps(serving_doc(identity, weights)))
    assert load_serving(path).fill == identity


@pytest.mark.parametrize("change, match", [
    ({"maps": {"path": "/nowhere/m.safetensors", "sha256": "ab"}}, "do not exist"),
    ({"maps": {"path": "MAPS", "sha256": "0" * 64}}, "changed since tune"),
    ({"maps": None}, "a ridge fill without its maps"),
    ({"maps": "MAPS"}, "a ridge fill without its maps"),
    ({"tail": 0}, "--tail 0"),
    ({"outlier_factor": -2}, "--outlier-factor -2"),
    ({"variant": "exact"}, "unknown variant 'exact'"),
    ({"kind": "other"}, "is not a ridgefill serving config"),
    ({"model": {}}, "lacks a valid"),
])
def test_a_bad_serving_config_is_one_line(session_and_maps, tmp_path, change, match):
    session, maps = session_and_maps
    doc = serving_doc(FillSettings("ridge", 3, maps), session.loaded.fingerprint, **change)
    if isinstance(doc.get("maps"), dict) and doc["maps"]["path"] == "MAPS":
        doc["maps"]["path"] = str(maps)
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RidgefillError, match=match) as caught:
        load_serving(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


class Options:
    def __init__(self, maps=None, split=None, tail=8, keep_first=1, outlier_factor=0.0):
        self.maps, self.split, self.tail, self.keep_first, self.outlier_factor = maps, split, tail, keep_first, \
            outlier_factor
        self.filled_window, self.filled_window_layers = 0, None


@pytest.mark.parametrize("variants", [("exact", "identity"), ("identity",), ("exact", "identity", "ridge")])
def test_the_split_comes_from_the_maps_whichever_variants_run(session_and_maps, variants):
    session, maps = session_and_maps
    plans, meta = variant_plans(session, Options(maps), variants)
    assert meta["split"] == 3
    assert all(plans[v].split == 3 for v in variants if v != "exact")


def test_split_is_checked_against_the_maps_without_ridge(session_and_maps):
    session, maps = session_and_maps
    assert variant_plans(session, Options(maps, 3), ("exact", "identity"))[0]["identity"].split == 3
    with pytest.raises(RidgefillError, match="split 3, not 2"):
        variant_plans(session, Options(maps, 2), ("exact", "identity"))


def test_without_maps_identity_takes_split_and_ridge_needs_maps(session_and_maps):
    session, _ = session_and_maps
    plans, meta = variant_plans(session, Options(None, 2), ("exact", "identity"))
    assert meta is None and plans["identity"].split == 2 and plans["exact"] is None
    with pytest.raises(RidgefillError, match="needs --maps"):
        variant_plans(session, Options(None, 2), ("exact", "ridge"))
    with pytest.raises(RidgefillError, match="--split"):
        variant_plans(session, Options(None, None), ("exact", "identity"))


def test_variants_parse_with_exact_first():
    assert parse_variants(None, None) == ["exact", "identity"]
    assert parse_variants("ridge,identity", "m") == ["exact", "identity", "ridge"]
    assert parse_variants("mean,drop", "m") == ["exact", "drop", "mean"]
    with pytest.raises(RidgefillError, match="unknown variant"):
        parse_variants("oracle", None)
    with pytest.raises(RidgefillError, match="the mean variant needs --maps"):
        parse_variants("drop,mean", None)


def test_the_controls_plan_and_serve_as_their_definitions_say(session_and_maps, tmp_path):
    """drop: no maps, a DropFiller; mean: the maps' calibration means (a MeanFiller), served by vLLM through a mean
    maps file written from them; drop is not served (one line)."""
    import torch

    from ridgefill.torchfill import DropFiller, MeanFiller
    from ridgefill.runtime.artifacts import load_artifact

    session, _ = session_and_maps
    n, hidden = session.runner.n_layers, session.runner.shape.hidden
    means = torch.randn(n - 3 - 1, hidden)
    maps = tmp_path / "with-means.safetensors"
    save_maps(maps, 3, n, [], {"model": session.loaded.info()}, "identity", means=means)
    plan, _ = FillSettings("drop", 2).plan(session)
    assert isinstance(plan.filler, DropFiller) and plan.split == 2
    plan, meta = FillSettings("mean", None, maps).plan(session)
    assert isinstance(plan.filler, MeanFiller) and plan.split == meta["split"] == 3
    late = plan.filler.late_inputs(torch.zeros(1, 2, hidden), torch.arange(2))
    assert torch.equal(late[1:], means.unsqueeze(1).expand(-1, 2, -1))
    served = pin(FillSettings("mean", None, maps), n, session.loaded.info(), tmp_path)
    tensors, stored = load_artifact(served.maps, "maps")
    assert stored["kind"] == "mean" and torch.equal(tensors["bias"], means)
    assert fill_from_env(fill_env(served)).variant == "mean"
    assert FillOptions(maps=served.maps).fill().variant == "mean"  # a mean maps file given as --maps fills mean
    assert FillOptions(maps=maps).fill().variant == "ridge"
    with pytest.raises(RidgefillError, match="carries no calibration means"):
        FillSettings("mean", None, session_and_maps[1]).plan(session)
    with pytest.raises(ValueError, match="drop fill has no maps to pin"):
        pin(FillSettings("drop", 2), n, session.loaded.info(), tmp_path)


def test_every_fill_setting_is_declared_once_and_every_consumer_derives_from_it(tmp_path):
    """FillSettings' fields are the FillFields (a field added without its FillField fails here); every one with help
    is an option of FillOptions with its default and help, every served one a serving.json key, every one with an
    environment variable in the plugin's environment, and tune's tail and keep-first are the same options."""
    import dataclasses

    from ridgefill.commands import options
    from ridgefill.method.fill import OPTIONS, ServedOptions
    from ridgefill.method.fill_fields import FIELD, FIELDS
    from ridgefill.pipeline.tune.options import TuneConfig

    assert [f.name for f in dataclasses.fields(FillSettings)] == ["variant", *FIELD]
    for f in dataclasses.fields(FillSettings)[1:]:
        assert f.default == FIELD[f.name].default, f.name
    declared = {o.name: o for o in options(FillOptions).values()}
    assert list(declared) == [f.name for f in FIELDS if f.help] == list(OPTIONS)
    for name, o in declared.items():
        assert (o.default, o.help) == (FIELD[name].default, FIELD[name].help), name
    assert [o.name for o in options(ServedOptions).values()] == [*OPTIONS, "serving_config"]
    tune = {o.name: o for o in options(TuneConfig).values()}
    assert (tune["tail"].default, tune["keep_first"].default) == (FIELD["tail"].default, FIELD["keep_first"].default)
    assert tune["keep_first"].help == FIELD["keep_first"].help
    assert tune["tail"].help.startswith(FIELD["tail"].help[:-1])
    maps = tmp_path / "m.safetensors"
    maps.write_bytes(b"maps")
    fill = FillSettings("ridge", 3, maps, maps_sha256="a" * 64)
    assert set(fill.to_serving()) == {"variant", "maps", *(f.name for f in FIELDS if f.served)}
    assert set(fill.describe()) == {"variant", *FIELD}
    assert set(ENV) == {f.name for f in FIELDS if f.env} and set(ENV.values()) <= set(fill_env(fill))
    from ridgefill.torchfill.prefill import DEFAULT_CHUNK
    from ridgefill.pipeline.recipe import TOP  # torch-free: the recipe's own defaults must agree
    from ridgefill.runtime.session import ModelConfig

    assert TOP["tails"][1] == [FIELD["tail"].default] and TOP["chunk"][1] == DEFAULT_CHUNK
    assert {o.name: o for o in options(ModelConfig).values()}["chunk"].default == DEFAULT_CHUNK
    assert FillOptions(split=3).fill("identity") == dataclasses.replace(fill, variant="identity", maps=None,
                                                                      maps_sha256=None)


@pytest.mark.parametrize("given, rule, match", [
    ({"serving_config": "s.json", "maps": "m"}, ((), None), r"^--serving-config sets the fill \(maps and split\): "
                                                            "drop --maps and --split$"),
    ({"serving_config": "s.json", "variants": "exact,ridge"}, (("variants",), None),
     r"^--serving-config sets the fill \(maps, split and variants\): drop --maps, --split and --variants$"),
    ({}, ((), ", or pass --exact"), r"^give --maps \(from ridgefill fit\), --split \(identity fill\) or "
                                    r"--serving-config \(from ridgefill tune\), or pass --exact$"),
])
def test_the_either_or_rule_is_one_function_for_generate_serve_and_bench_ttft(given, rule, match):
    from types import SimpleNamespace

    from ridgefill.method.fill import check_fill_source

    c = SimpleNamespace(**{"serving_config": None, "maps": None, "split": None, "variants": None, **given})
    with pytest.raises(RidgefillError, match=match):
        check_fill_source(c, *rule)
    check_fill_source(SimpleNamespace(serving_config="s.json", maps=None, split=None, variants=None), *rule)


@pytest.mark.parametrize("tail", [0, -3, True, 2.0])
def test_one_tail_rule_for_the_fill_the_engine_ruler_placement_and_the_plugins_requests(tail):
    """tail >= 1 (an integer) is torchfill/prefill's tail_ok, behind every consumer's one-line refusal."""
    from ridgefill.torchfill import FillPlan, IdentityFiller
    from ridgefill.evals.ruler.placement import check_region
    from ridgefill.backends.vllm.requests import check_request_args

    with pytest.raises(RidgefillError, match=rf"^--tail {tail} must be an integer of at least 1: the last prompt row"):
        FillSettings("identity", 3, tail=tail)
    with pytest.raises(RidgefillError, match=rf"^--tail {tail} must be an integer of at least 1"):
        check_region("filled", tail, 1, 512)
    with pytest.raises(RidgefillError, match=rf"^tail {tail} must be an integer of at least 1"):
        FillPlan(IdentityFiller(2, 6), tail=tail)
    with pytest.raises(ValueError, match=rf"^ridgefill_tail={tail!r} is not valid: give an integer in 1\.\."):
        check_request_args({"ridgefill_tail": tail})
    check_region("filled", 1, 0, 512)
    check_request_args({"ridgefill_tail": 1, "ridgefill_keep_first": 0})
