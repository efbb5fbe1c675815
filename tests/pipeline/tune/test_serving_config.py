"""Serving configs (from `ridgefill tune`): read, checked, and taken by generate and bench-ttft."""

import json

import pytest

from ridgefill.errors import RidgefillError
from ridgefill.evals.bench_ttft import COMMAND as bench_ttft
from ridgefill.runtime.models import checkpoint_fingerprint
from ridgefill.method.fill import SERVING_KIND as KIND, load_serving
from ridgefill.evals.generate import COMMAND as generate

PROMPT = "The grass is green. The sky is blue. One of the special magic numbers for king is: 1234567. " * 3


def serving_file(path, **fields):
    doc = {"kind": KIND, "version": 1, "variant": "identity", "split": 3, "tail": 8, "keep_first": 1, "maps": None,
           "model": {"id": "tiny", "weights_hash": "x"}, **fields}
    path.write_text(json.dumps(doc))
    return path


def test_generate_with_a_serving_config_is_generate_with_its_settings(tiny_checkpoint, tmp_path, capsys):
    config = serving_file(tmp_path / "serving.json", model={"id": "t", "weights_hash":
                                                             checkpoint_fingerprint(tiny_checkpoint)})
    served = generate(model=str(tiny_checkpoint), prompt=PROMPT, serving_config=config, max_new_tokens=6)
    direct = generate(model=str(tiny_checkpoint), prompt=PROMPT, split=3, tail=8, max_new_tokens=6)
    assert served == direct and served["filled"]
    doc = bench_ttft(model=str(tiny_checkpoint), serving_config=config, lengths="64", repeats=1, warmup=0,
                     data="random", out=tmp_path / "ttft.json")
    assert doc["variants"] == ["exact", "identity"] and doc["split"] == 3 and doc["config"]["tail"] == 8


def test_a_serving_config_for_another_model_is_refused(tiny_checkpoint, tmp_path):
    config = serving_file(tmp_path / "serving.json")
    with pytest.raises(RidgefillError, match="was tuned for another model"):
        generate(model=str(tiny_checkpoint), prompt=PROMPT, serving_config=config, max_new_tokens=2)


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
    ('{"kind": "other"}', "is not a ridgefill serving config"),
    (json.dumps({"kind": KIND, "variant": "ridge", "split": 3, "tail": 8, "keep_first": 1,
                 "model": {"weights_hash": "x"}}), "without its maps"),
    (json.dumps({"kind": KIND, "variant": "identity", "tail": 8, "keep_first": 1, "model": {}}), "lacks a valid"),
])
def test_malformed_serving_configs_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "serving.json"
    path.write_text(text)
    with pytest.raises(RidgefillError, match=message):
        load_serving(path)


def test_serving_config_and_explicit_fill_options_exclude_each_other(tmp_path):
    with pytest.raises(RidgefillError, match="drop --maps and --split"):
        generate.make(prompt="x", serving_config=tmp_path / "s.json", split=3).check()


@pytest.mark.parametrize("pin", [{"sha256": ""}, {"sha256": "a"}, {"hash": "a"}, {"sha256": None, "hash": "0" * 16},
                                 {"sha256": "{prefix}"}, {"sha256": "{whole}z"}, {"sha256": 7}, {}],
                         ids=["empty", "one-digit", "one-digit-hash", "old-16-digit-hash", "true-prefix",
                              "not-hex", "not-a-string", "none"])
def test_a_maps_pin_that_is_not_a_whole_sha256_is_refused(tmp_path, pin):
    """A serving config pins its maps by their whole sha256 (64 hex digits): an empty, a one-character or any
    shorter pin (even a true prefix of the file's hash, or the 16-digit `hash` of older configs) would accept other
    bytes, and is refused in one line; the whole hash, in either case, is taken."""
    import hashlib

    maps = tmp_path / "maps.safetensors"
    maps.write_bytes(b"some maps")
    whole = hashlib.sha256(b"some maps").hexdigest()
    pin = {k: v.format(prefix=whole[:63], whole=whole[:63]) if isinstance(v, str) else v for k, v in pin.items()}
    config = serving_file(tmp_path / "serving.json", variant="ridge", maps={"path": str(maps), **pin})
    with pytest.raises(RidgefillError, match=r"^--serving-config .*: its maps' sha256 .* is not a whole sha256 \(64 "
                                             r"hex digits\): rerun `ridgefill tune`[^\n]*$"):
        load_serving(config)
    for taken in (whole, whole.upper()):
        serving_file(config, variant="ridge", maps={"path": str(maps), "sha256": taken})
        assert load_serving(config).fill.maps_sha256 == whole


@pytest.mark.parametrize("pin", ["a", "0" * 16, "0" * 63, "g" * 64])
def test_the_plugins_pin_must_be_a_whole_sha256(tmp_path, pin):
    """RIDGEFILL_MAPS_SHA256 (what every vLLM process checks the maps against) and load_private's pin: a value that is
    not 64 hex digits is refused in one line (unset or empty: no pin)."""
    from ridgefill.method.fill_fields import ENV
    from ridgefill.backends.vllm.fill import fill_from_env
    from ridgefill.method.maps import save_maps
    from ridgefill.runtime.artifacts import load_private

    maps = tmp_path / "maps.safetensors"
    save_maps(maps, 3, 6, [], {"model": {"id": "tiny", "weights_hash": "x"}}, "identity")
    with pytest.raises(RidgefillError, match=rf"^{ENV['maps_sha256']}='{pin}' is not a whole sha256 \(64 hex digits\)"):
        fill_from_env({ENV["maps"]: str(maps), ENV["maps_sha256"]: pin})
    with pytest.raises(RidgefillError, match=r"is not a whole sha256 \(64 hex digits\): pin the file by its full"):
        load_private(maps, "maps", pin)
    assert fill_from_env({ENV["maps"]: str(maps), ENV["maps_sha256"]: ""}).maps_sha256 is None
