"""Issue #12 bug 9: given --maps, every variant runs at the maps' split, also when ridge is not among them, and
--split is checked against it."""

from __future__ import annotations

import pytest

from ridgefill.errors import RidgefillError
from ridgefill.method.maps import save_maps
from ridgefill.runtime.session import open_session, variant_plans


@pytest.fixture(scope="module")
def session_and_maps(tiny_checkpoint, tmp_path_factory):
    session = open_session(str(tiny_checkpoint))
    maps = tmp_path_factory.mktemp("maps") / "maps-s3.safetensors"
    save_maps(maps, 3, session.engine.n_layers, [], {"model": session.loaded.info()}, "identity")
    return session, str(maps)


@pytest.mark.parametrize("variants", [("exact", "identity"), ("identity",), ("exact", "identity", "ridge")])
def test_the_split_comes_from_the_maps_whichever_variants_run(session_and_maps, variants):
    session, maps = session_and_maps
    plans, meta = variant_plans(session, maps, None, 8, (0,), variants)
    assert meta["split"] == 3
    assert all(plans[v].split == 3 for v in variants if v != "exact")


def test_split_is_checked_against_the_maps_without_ridge(session_and_maps):
    session, maps = session_and_maps
    assert variant_plans(session, maps, 3, 8, (0,), ("exact", "identity"))[0]["identity"].split == 3
    with pytest.raises(RidgefillError, match="split 3, not 2"):
        variant_plans(session, maps, 2, 8, (0,), ("exact", "identity"))


def test_without_maps_identity_takes_split_and_ridge_needs_maps(session_and_maps):
    session, _ = session_and_maps
    plans, meta = variant_plans(session, None, 2, 8, (0,), ("exact", "identity"))
    assert meta is None and plans["identity"].split == 2 and plans["exact"] is None
    with pytest.raises(RidgefillError, match="needs --maps"):
        variant_plans(session, None, 2, 8, (0,), ("exact", "ridge"))
    with pytest.raises(RidgefillError, match="--split"):
        variant_plans(session, None, None, 8, (0,), ("exact", "identity"))
