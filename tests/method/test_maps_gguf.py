"""Maps as a GGUF adapter (method/maps_gguf.py): `fit --out maps.gguf` and `convert-maps` write llama.cpp's adapter
conventions (general.type, adapter.type, the architecture, ridgefill.* keys, per-layer tensors), and every reader of
maps reads one back as the safetensors maps (exactly in F32, within F16's rounding in F16); a GGUF that is not a
ridgefill adapter, or one for another architecture, layer count, width, KV heads or model, is one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from bad_input_kit import gguf_rewritten
from ridgefill.commands import command
from ridgefill.errors import RidgefillError
from ridgefill.method import maps_gguf
from ridgefill.method.maps import check_for_model, load_filler, load_maps, read_maps_meta, write_maps
from ridgefill.runtime.models import model_identity
from ridgefill.runtime.paths import file_sha256

pytestmark = pytest.mark.usefixtures("one_thread")
FIT, CONVERT = command("fit"), command("convert-maps")
Q8_0 = GGMLQuantizationType.Q8_0
KEPT = ("kind", "split", "n_layers", "data", "tokens", "seq_len", "rank", "targets", "errors_on", "layers")


@pytest.fixture(scope="module")
def fitted(tiny_fitted, tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's split-3 statistics fitted to safetensors, to GGUF in F16 (the default) and F32, and
    the model's info."""
    root = tmp_path_factory.mktemp("maps-gguf")
    out = {"safetensors": tiny_fitted.maps[3], "f16": root / "maps.gguf", "f32": root / "maps-f32.gguf"}
    FIT(stats=tiny_fitted.stats, split=3, out=out["f16"])
    FIT(stats=tiny_fitted.stats, split=3, out=out["f32"], gguf_type="f32")
    return out, model_identity(str(tiny_checkpoint)).info


def _fields(path) -> dict:
    return {name: f.contents() for name, f in GGUFReader(path).fields.items() if not name.startswith("GGUF.")}


def assert_f16_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` is `want` rounded to F16: within half an F16 unit in the last place (2^-11 relative, 2^-25 absolute
    below F16's normal range) and exactly what torch's rounding to F16 gives."""
    assert torch.equal(got, want.half().float())
    assert ((got - want).abs() <= want.abs() * 2.0 ** -11 + 2.0 ** -25).all()


def test_fit_writes_a_ridgefill_adapter_in_llamacpps_conventions(fitted):
    files, info = fitted
    fields = _fields(files["f16"])
    assert (fields["general.type"], fields["adapter.type"], fields["general.architecture"]) == \
        ("adapter", "ridgefill", "llama")
    assert (fields["ridgefill.split"], fields["ridgefill.block_count"], fields["ridgefill.embedding_length"],
            fields["ridgefill.attention.head_count_kv"]) == (3, 6, info["hidden_size"], info["kv_heads"])
    assert fields["ridgefill.model.weights_hash"] == info["weights_hash"]
    assert (fields["ridgefill.kind"], fields["ridgefill.rank"], fields["ridgefill.matrix_type"]) == ("ridge", 0, "f16")
    assert (fields["ridgefill.fill.tail"], fields["ridgefill.fill.keep_first"],
            fields["ridgefill.fill.outlier_factor"]) == (256, 1, 20.0)
    assert fields["ridgefill.calibration.tokens"] == 2048 and fields["ridgefill.calibration.seq_len"] == 128
    tensors = {t.name: t for t in GGUFReader(files["f16"]).tensors}
    assert sorted(tensors) == sorted(f"blk.{l}.ridgefill.{n}" for l in (4, 5) for n in ("weight", "bias", "mean"))
    h = info["hidden_size"]
    assert tensors["blk.4.ridgefill.weight"].tensor_type.name == "F16"
    assert [int(d) for d in tensors["blk.4.ridgefill.weight"].shape] == [h, h]  # ne: [in, out]
    assert tensors["blk.4.ridgefill.bias"].tensor_type.name == "F32"
    assert tensors["blk.4.ridgefill.mean"].tensor_type.name == "F32"
    assert {t.tensor_type.name for t in GGUFReader(files["f32"]).tensors} == {"F32"}


def test_gguf_maps_read_back_as_the_safetensors_maps(fitted):
    files, _ = fitted
    want, meta, _ = load_maps(files["safetensors"])
    for kind in ("f32", "f16"):
        got, back, digest = load_maps(files[kind])
        assert digest == file_sha256(files[kind]) and set(got) == set(want)
        for name in want:
            if kind == "f32" or name != "weight":  # biases and means are F32 in either
                assert torch.equal(got[name], want[name]), (kind, name)
            else:
                assert_f16_rounded(got[name], want[name])
        assert {k: back.get(k) for k in KEPT} == {k: meta.get(k) for k in KEPT}
        assert back["model"]["weights_hash"] == meta["model"]["weights_hash"]
        assert read_maps_meta(files[kind]) == back


def test_the_filler_of_gguf_maps_is_the_safetensors_filler(fitted):
    files, info = fitted
    x = torch.randn(1, 7, info["hidden_size"], generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7)
    want = load_filler(files["safetensors"], info, 3, n_layers=6)[0].predict(x, pos)
    got, meta = load_filler(files["f32"], info, 3, n_layers=6, sha256=file_sha256(files["f32"]))
    assert torch.equal(got.predict(x, pos), want) and meta["sha256"] == file_sha256(files["f32"])
    f16 = load_filler(files["f16"], info, 3)[0].predict(x, pos)
    assert (f16 - want).abs().max() <= 1e-3 * want.abs().max()
    mean = load_filler(files["f32"], info, mean=True)[0]
    assert torch.equal(mean.predict(x, pos), load_filler(files["safetensors"], info, mean=True)[0].predict(x, pos))


def test_the_sha256_pin_holds_on_the_gguf_bytes(fitted, tmp_path):
    files, _ = fitted
    copy = tmp_path / "maps.gguf"
    copy.write_bytes(files["f16"].read_bytes())
    pin = file_sha256(copy)
    assert load_maps(copy, pin)[2] == pin
    copy.write_bytes(files["f32"].read_bytes())
    with pytest.raises(RidgefillError, match="changed since it was checked"):
        load_maps(copy, pin)


def test_convert_maps_round_trips(fitted, tmp_path):
    files, _ = fitted
    want, meta, digest = load_maps(files["safetensors"])
    summary = CONVERT(maps=files["safetensors"], out=tmp_path / "m.gguf", gguf_type="f32")
    assert summary["format"] == "gguf" and summary["from"]["sha256"] == digest
    CONVERT(maps=tmp_path / "m.gguf", out=tmp_path / "back.safetensors")
    back, again, _ = load_maps(tmp_path / "back.safetensors")
    assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)
    assert {k: again.get(k) for k in KEPT} == {k: meta.get(k) for k in KEPT} and "gguf" not in again
    assert again["converted_from"]["path"] == str(tmp_path / "m.gguf")
    CONVERT(maps=files["f16"], out=tmp_path / "from-f16.safetensors")  # what F16 stored, in fp32
    f16 = load_maps(files["f16"])[0]
    assert all(torch.equal(load_maps(tmp_path / "from-f16.safetensors")[0][k], f16[k]) for k in f16)


@pytest.mark.parametrize("kind", ["low-rank", "identity", "mean", "key-scale"])
def test_every_kind_of_maps_round_trips(kind, tiny_fitted, fitted, tmp_path):
    _, info = fitted
    st, gg = tmp_path / "m.safetensors", tmp_path / "m.gguf"
    options = {"low-rank": {"rank": 4}, "identity": {"kind": "identity"}, "mean": {"kind": "mean"}}.get(kind, {})
    FIT(stats=tiny_fitted.stats, split=3, out=st, **options)
    if kind == "key-scale":  # as `ridgefill key-scale` writes it
        tensors, meta, _ = load_maps(st)
        write_maps(st, {**tensors, "key_scale": 0.5 + torch.rand(3, info["kv_heads"])}, {**meta, "key_scale": {}})
    CONVERT(maps=st, out=gg, gguf_type="f32")
    want, got = load_maps(st)[0], load_maps(gg)[0]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    names = {t.name for t in GGUFReader(gg).tensors}
    expected = {"low-rank": {"blk.4.ridgefill.u", "blk.5.ridgefill.v"}, "identity": {"blk.5.ridgefill.mean"},
                "mean": {"blk.4.ridgefill.bias"}, "key-scale": {"blk.3.ridgefill.key_scale"}}[kind]
    assert expected <= names
    if kind == "low-rank":
        fields = _fields(gg)
        assert fields["ridgefill.rank"] == 4
        assert [int(d) for d in GGUFReader(gg).tensors[0].shape] == [info["hidden_size"], 4]  # u: ne [in, r]
    x = torch.randn(1, 5, info["hidden_size"])
    a, b = (load_filler(p, info, 3)[0] for p in (st, gg))
    assert torch.equal(a.late_inputs(x, torch.arange(5)), b.late_inputs(x, torch.arange(5)))


# --- refusals, one line each ---------------------------------------------------------------------------------------
def _written(tmp_path, data: bytes, name: str = "x.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _refused(match: str, call, *args, **kwargs) -> str:
    with pytest.raises(RidgefillError, match=match) as caught:
        call(*args, **kwargs)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_gguf_that_is_no_ridgefill_adapter_is_refused(fitted, tmp_path):
    files, info = fitted
    model = tmp_path / "model.gguf"
    writer = GGUFWriter(str(model), "llama")
    writer.add_type("model")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    _refused("is not a ridgefill maps file \\(found: a GGUF model of architecture llama\\)", load_maps, model)
    lora = _written(tmp_path, gguf_rewritten(files["f32"], {"adapter.type": "lora"}))
    _refused("is not a ridgefill maps file \\(found: a lora adapter\\)", load_filler, lora, info)
    no_split = _written(tmp_path, gguf_rewritten(files["f32"], drop=("ridgefill.split",)))
    _refused("has no valid ridgefill.split and ridgefill.block_count \\(found None, 6\\)", load_maps, no_split)
    newer = _written(tmp_path, gguf_rewritten(files["f32"], {"ridgefill.format_version": 9}))
    _refused("of format 9, which this ridgefill \\(format 1\\) cannot read", read_maps_meta, newer)
    cut = _written(tmp_path, files["f32"].read_bytes()[:-100])
    _refused("it is corrupted or truncated", load_maps, cut)


@pytest.mark.parametrize("key, value, match", [
    ("general.architecture", "qwen2", "holds maps for a qwen2 model, this model is llama"),
    ("ridgefill.embedding_length", 128, "holds maps for a model of width 128, this model's is 64"),
    ("ridgefill.attention.head_count_kv", 4, "holds maps for a model with 4 KV heads, this model has 2"),
    ("ridgefill.model.weights_hash", "0123456789abcdef", "was fitted for another model"),
])
def test_an_adapter_for_another_model_is_refused(key, value, match, fitted, tmp_path):
    files, info = fitted
    if key == "general.architecture":
        data = gguf_rewritten(files["f32"], arch=value)
    else:
        data = gguf_rewritten(files["f32"], {key: value})
    _refused(match, load_filler, _written(tmp_path, data), info, n_layers=6)


def test_an_adapter_for_another_layer_count_or_with_a_layer_missing_is_refused(fitted, tmp_path):
    files, info = fitted
    tensors, meta, _ = load_maps(files["safetensors"])
    seven = {k: torch.cat([t, t[-1:]]) for k, t in tensors.items()}
    path = tmp_path / "seven.gguf"
    write_maps(path, seven, {**meta, "n_layers": 7, "model": {**meta["model"], **{
        k: info[k] for k in ("family", "hidden_size", "kv_heads")}}}, "f32")
    _refused("holds maps for a 7-layer model, this model has 6 layers", load_filler, path, info, n_layers=6)
    gap = _written(tmp_path, gguf_rewritten(files["f32"], drop=("blk.5.ridgefill.weight",)))
    _refused("has weight for layers \\[4\\], not \\[4, 5\\]", load_maps, gap)
    odd = _written(tmp_path, gguf_rewritten(files["f32"], tensors={"blk.4.ridgefill.extra": np.zeros(4, np.float32)}))
    _refused("holds a tensor blk.4.ridgefill.extra, which is no ridgefill map's", load_maps, odd)
    q8 = (quantize(np.ones(64, np.float32), Q8_0), Q8_0)
    quantized = _written(tmp_path, gguf_rewritten(files["f32"], drop=("blk.4.ridgefill.bias",),
                                                  tensors={"blk.4.ridgefill.bias": q8}))
    _refused("holds blk.4.ridgefill.bias as Q8_0; ridgefill maps are F16 or F32", load_maps, quantized)


def test_maps_llamacpp_cannot_run_are_not_written_as_gguf(fitted, tmp_path):
    files, info = fitted
    tensors, meta, _ = load_maps(files["safetensors"])
    out = tmp_path / "m.gguf"
    _refused("maps with lookback have no llama.cpp form", write_maps, out, tensors, {**meta, "lookback": 1})
    window = {"size": 64, "first": 0, "last": 2}
    _refused("maps with a filled window have no llama.cpp form", write_maps, out, tensors,
             {**meta, "filled_window": window})
    hybrid = {**meta, "model": {**meta["model"], "family": "qwen3_5", "hidden_size": 64, "kv_heads": 2}}
    _refused("the maps are for a qwen3_5 model, and llama.cpp fills llama, qwen2, qwen3", write_maps, out, tensors,
             hybrid)
    huge = {**tensors, "weight": tensors["weight"] * 1e6}
    _refused("weight holds a NaN or an infinity as fp16: write them as f32 \\(--gguf-type f32\\)", write_maps, out,
             huge, meta, model=str(info["id"]))
    assert not out.exists() and write_maps(out, huge, meta, "f32", model=str(info["id"])) is None


def test_the_gguf_type_option_is_checked(fitted, tmp_path):
    files, _ = fitted
    _refused("unknown --gguf-type 'q8_0': use f16 or f32", CONVERT, maps=files["safetensors"],
             out=tmp_path / "m.gguf", gguf_type="q8_0")
    _refused("--gguf-type sets the type of a .gguf --out", CONVERT, maps=files["f16"],
             out=tmp_path / "m.safetensors", gguf_type="f32")
    assert maps_gguf.is_gguf_path("M.GGUF") and not maps_gguf.is_gguf(tmp_path / "missing.gguf")


def test_check_for_model_without_the_models_facts_checks_the_fingerprint_alone(fitted):
    files, info = fitted
    meta = read_maps_meta(files["f16"])
    check_for_model(files["f16"], meta, {"weights_hash": info["weights_hash"]}, 3)  # as vLLM's check passes it
    _refused("was fitted for another model", check_for_model, files["f16"], meta, {"weights_hash": "other"})


def test_every_fill_plans_from_gguf_maps_as_from_safetensors(fitted, tiny_checkpoint):
    from ridgefill.method.fill import FillSettings, read_kind
    from ridgefill.runtime.session import model_facts

    files, _ = fitted
    model = model_facts(str(tiny_checkpoint))
    x = torch.randn(1, 6, model.shape.hidden, generator=torch.Generator().manual_seed(1))
    for variant in ("ridge", "identity", "mean"):
        plans = {k: FillSettings(variant, maps=files[k], tail=4).plan(model) for k in ("safetensors", "f32")}
        (want, meta_st), (got, meta) = plans["safetensors"], plans["f32"]
        assert meta["split"] == meta_st["split"] == 3 and meta["sha256"] == file_sha256(files["f32"])
        assert torch.equal(got.filler.late_inputs(x, torch.arange(6)), want.filler.late_inputs(x, torch.arange(6)))
    assert read_kind(files["f16"]) == "ridge" and FillSettings("ridge", maps=files["f16"]).window(3) is None


def test_key_scale_reads_and_writes_gguf_maps(fitted, tiny_fitted, tiny_checkpoint, tmp_path):
    """`key-scale --maps maps.gguf --out ks.gguf` (F32 maps): the key scale of the safetensors maps, per layer S..L-1
    in the adapter, the maps themselves unchanged."""
    files, _ = fitted
    scaled = {}
    for name, maps in (("safetensors", files["safetensors"]), ("gguf", files["f32"])):
        out = tmp_path / f"ks.{name}"
        command("key-scale")(model=str(tiny_checkpoint), maps=maps, data=str(tiny_fitted.text), tokens=256,
                             seq_len=128, out=out)
        scaled[name] = load_maps(out)[0]
    names = {t.name for t in GGUFReader(tmp_path / "ks.gguf").tensors}
    assert {f"blk.{l}.ridgefill.key_scale" for l in (3, 4, 5)} <= names
    assert torch.equal(scaled["gguf"]["key_scale"], scaled["safetensors"]["key_scale"])
    assert_f16_rounded(scaled["gguf"]["weight"], scaled["safetensors"]["weight"])  # written F16 (the default)
