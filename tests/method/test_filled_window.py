"""The filled window as a user sets it (method/fill.py, calibrate, fit): calibrate --filled-window -> fit -> maps that
carry it -> every variant's plan runs with it; a window the maps were not calibrated with is refused, and so is
serving one in vLLM (not built yet), in one line."""

import json

import pytest
import torch

from ridgefill.torchfill import FilledWindow
from ridgefill.errors import RidgefillError
from ridgefill.method.calibrate import COMMAND as CALIBRATE
from ridgefill.method.fill import FillOptions, FillSettings, load_serving
from ridgefill.method.fit import COMMAND as FIT
from ridgefill.runtime.artifacts import load_artifact, read_meta
from ridgefill.runtime.session import open_session
from ridgefill.backends.vllm.fill import fill_from_env


@pytest.fixture(scope="module")
def windowed(tiny_checkpoint, tiny_fitted, tmp_path_factory):
    """Maps at split 3 calibrated with window 8 on conftest.tiny_fitted's corpus and token budget, beside that
    fixture's full-attention ones (`plain`), and the session."""
    out = tmp_path_factory.mktemp("window")
    stats = {"windowed": out / "windowed.stats.safetensors", "plain": tiny_fitted.stats}
    CALIBRATE(model=str(tiny_checkpoint), data=str(tiny_fitted.text), split="3", tokens=2048, seq_len=128,
              out=stats["windowed"], holdout=0.25, filled_window=8)
    maps = {"windowed": out / "windowed.maps.safetensors", "plain": tiny_fitted.maps[3]}
    FIT(stats=stats["windowed"], out=maps["windowed"], split=3)
    return open_session(str(tiny_checkpoint)), maps, stats


def test_calibrate_and_fit_carry_the_window_into_the_maps(windowed):
    session, maps, stats = windowed
    windowed_stats, meta = load_artifact(stats["windowed"], "stats")
    plain, _ = load_artifact(stats["plain"], "stats")
    assert meta["filled_window"] == {"size": 8, "first": 0, "last": 2}  # below the lowest split (3)
    # the same rows (same corpus, budget and holdout), so the window is what shaped the split states
    assert not torch.allclose(windowed_stats["s3.train.xtx"], plain["s3.train.xtx"])
    assert read_meta(maps["windowed"], "maps")["filled_window"] == {"size": 8, "first": 0, "last": 2}
    assert "filled_window" not in read_meta(maps["plain"], "maps")
    fitted = json.loads((maps["windowed"].parent / "windowed.maps.safetensors.json").read_text())
    assert fitted["filled_window"] == {"size": 8, "first": 0, "last": 2}


@pytest.mark.parametrize("variant", ["ridge", "identity", "drop", "mean"])
def test_every_variant_at_windowed_maps_runs_with_their_window(windowed, variant):
    session, maps, _ = windowed
    plan, _ = FillSettings(variant, None, maps["windowed"], keep_first=2).plan(session)
    assert plan.window == FilledWindow(8, 0, 2, sinks=2)  # the sinks are the kept first rows
    plan, _ = FillSettings(variant, None, maps["windowed"], filled_window=8).plan(session)  # repeating it is fine
    assert plan.window == FilledWindow(8, 0, 2, sinks=1)
    assert FillSettings(variant, None, maps["plain"]).plan(session)[0].window is None


def test_identity_without_maps_takes_the_window_asked(windowed):
    session, _, _ = windowed
    plan, _ = FillSettings("identity", 4, filled_window=16).plan(session)
    assert plan.window == FilledWindow(16, 0, 3, sinks=1)
    plan, _ = FillSettings("identity", 4, filled_window=16, filled_window_layers="1-2").plan(session)
    assert plan.window == FilledWindow(16, 1, 2, sinks=1)
    with pytest.raises(RidgefillError, match="at or above the split 4"):
        FillSettings("identity", 4, filled_window=16, filled_window_layers="1-4").plan(session)


@pytest.mark.parametrize("kwargs, match", [
    ({"maps": "windowed", "filled_window": 16}, "calibrated with window 8, layers 0-2 .* not --filled-window 16"),
    ({"maps": "windowed", "filled_window": 8, "filled_window_layers": "1-2"}, "not --filled-window 8 \\(layers 1-2"),
    ({"maps": "plain", "filled_window": 8}, "calibrated with full attention"),
])
def test_a_window_the_maps_were_not_calibrated_with_is_refused(windowed, kwargs, match):
    session, maps, _ = windowed
    kwargs = {**kwargs, "maps": maps[kwargs["maps"]]}
    with pytest.raises(RidgefillError, match=match) as caught:
        FillSettings("ridge", None, **kwargs).plan(session)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"filled_window": -1}, "--filled-window -1 must be an integer of at least 0"),
    ({"filled_window": 0, "filled_window_layers": "0-2"}, "needs --filled-window W > 0"),
])
def test_bad_window_settings_are_one_line(kwargs, match):
    with pytest.raises(RidgefillError, match=match):
        FillSettings("identity", 3, **kwargs)
    with pytest.raises(RidgefillError, match=match):
        FillOptions(split=3, **kwargs).check()


def test_vllm_refuses_a_window_in_one_line(windowed, tmp_path):
    """The one fill check (serve's and every measuring command's) refuses a window asked for or carried by the maps
    for an engine without filled windows; the plugin refuses maps that carry one when vLLM is started by hand."""
    from ridgefill.backends import backend_class
    from ridgefill.backends.base import check_fill

    session, maps, _ = windowed
    vllm = backend_class("vllm")
    with pytest.raises(RidgefillError, match="^a filled window \\(--filled-window, or one the maps carry\\) is not "
                                             "supported with --engine vllm: use maps calibrated without a window$"):
        check_fill(vllm, FillSettings("ridge", None, maps["windowed"]), session.facts())
    with pytest.raises(RidgefillError, match="^--filled-window is not supported with --engine vllm: drop it$"):
        check_fill(vllm, FillSettings("identity", 3, filled_window=32), session.facts())
    assert check_fill(backend_class("torchfill"), FillSettings("ridge", None, maps["windowed"]),
                      session.facts()).window is not None
    with pytest.raises(RidgefillError, match="does not serve a filled window"):
        fill_from_env({"RIDGEFILL_MAPS": str(maps["windowed"])})
    assert fill_from_env({"RIDGEFILL_MAPS": str(maps["plain"])}).variant == "ridge"


def test_a_serving_config_carries_the_window(windowed, tmp_path):
    session, _, _ = windowed
    fill = FillSettings("identity", 3, tail=16, filled_window=64, filled_window_layers="0-1")
    doc = {"kind": "ridgefill-serving-config", "version": 2, "model": {"weights_hash": session.loaded.fingerprint},
           **fill.to_serving()}
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(doc))
    tuned = load_serving(path)
    assert tuned.fill == fill
    assert FillOptions().with_serving(tuned).fill("identity") == fill
