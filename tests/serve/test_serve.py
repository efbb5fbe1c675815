"""`ridgefill serve`, in process: what it hands to vLLM (argv, environment, banner), the checks of the vLLM
installation, launch's signal forwarding, and every bad configuration is one line on stderr and exit code 2 before
any vLLM process starts. The lookups and the launch are replaced, so these run everywhere (the bad configurations
use the vLLM tests' checkpoints, which skip without vLLM). The server itself, started as a user starts it, is
tested in tests/backends/vllm/test_vllm_server.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import free_port, run_captured
from ridgefill.errors import RidgefillError
from ridgefill.serve import serve
from ridgefill.backends.vllm import server as vserving
from ridgefill.backends.vllm.config import ENV, VLLM_VERSION
from ridgefill.backends.vllm.malloc import TUNABLES


# --- in-process: what serve hands to vLLM, and the vLLM installation's checks ---------------------------------
@pytest.fixture(scope="module")
def split3_maps(tiny_fitted) -> Path:
    """Maps fitted on the tiny checkpoint (split 3): conftest.tiny_fitted's."""
    return tiny_fitted.maps[3]


@pytest.fixture
def vllm_ok(monkeypatch):
    """The installation checks pass; launch records the plan (argv, env, banner) and returns `launched["code"]`."""
    launched = {"code": 0}

    def launch(plan):
        launched.update(argv=plan.argv, env=plan.env, banner=plan.banner, health=plan.health)
        return launched["code"]

    monkeypatch.setattr(vserving, "installed_vllm_version", lambda: VLLM_VERSION)
    monkeypatch.setattr(vserving, "plugin_installed", lambda: True)
    monkeypatch.setattr(serve, "launch", launch)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    return launched


def main(monkeypatch, capfd, *args) -> tuple[int, str]:
    """`ridgefill ARGS` through the console entry point: (exit code, stderr)."""
    done = run_captured(list(args), capfd, monkeypatch)
    return done.returncode, done.stderr


def test_serve_runs_the_vllm_server_with_the_fill_and_hands_on_undeclared_options(
        tiny_checkpoint, split3_maps, vllm_ok, monkeypatch, capfd, tmp_path):
    monkeypatch.setattr(vserving, "on_cpu", lambda: True)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "GLIBC_TUNABLES", "LD_PRELOAD", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--maps", split3_maps, "--tail", 16,
                     "--max-model-len", 256, "-tp", 1, "--max_num_seqs=4", "--port", 8123, "--seed", 3,
                     "--no-enable-log-requests", "--concurrency", 3)
    assert code == 0 and err == "", err  # serve's line comes once the server answers (launch prints it)
    folder = str(tiny_checkpoint)
    kv = 3 * 256 * 2 * 6 * 2 * 16 * 4  # 3 requests of 256 tokens, K and V of 6 layers x 2 KV heads x 16, fp32
    assert vllm_ok["argv"] == [
        sys.executable, "-m", vserving.VLLM_SERVER, "--model", folder, "--served-model-name", "llama",
        "--host", "127.0.0.1", "--port", "8123", "--dtype", "float32", "--middleware", serve.GUARD,
        "--kv-cache-memory-bytes", str(kv),
        "--max-model-len", "256", "-tp", "1", "--max_num_seqs=4", "--seed", "3", "--no-enable-log-requests"]
    env = vllm_ok["env"]
    assert env[ENV["maps"]] == str(split3_maps.resolve()) and env[ENV["tail"]] == "16"
    assert env[ENV["keep_first"]] == "1" and float(env[ENV["outlier_factor"]]) == 20.0
    assert env[ENV["maps_sha256"]] == hashlib.sha256(split3_maps.read_bytes()).hexdigest()
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["PROMETHEUS_MULTIPROC_DIR"]
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is inherited
    assert env["GLIBC_TUNABLES"] == TUNABLES  # vLLM's processes keep freed memory (backends/vllm/malloc.py)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # a compile cache that loads (vllm_config.compile_cache_env)
    stock = serve.ServeConfig(model=folder, maps=split3_maps, port=free_port(), server_args=["--max-model-len", "256"])
    assert serve.stock_plan(stock, tmp_path, tmp_path / "stock.log").env["GLIBC_TUNABLES"] == TUNABLES  # bench-serve's
    assert vllm_ok["banner"].startswith("ridgefill serve: ") and "split 3 of 6 layers" in vllm_ok["banner"]
    assert "KV cache 0.00 GiB: 3 requests of 256 tokens" in vllm_ok["banner"]
    assert vllm_ok["health"] == "http://127.0.0.1:8123/health"


def test_serve_exits_with_the_servers_exit_code_and_a_served_name_given_is_kept(
        tiny_checkpoint, split3_maps, vllm_ok, monkeypatch, capfd):
    vllm_ok["code"] = 3
    code, _ = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--maps", split3_maps, "--dtype", "bf16",
                   "--served-model-name", "tiny")
    assert code == 3
    argv = vllm_ok["argv"]
    assert argv.count("--served-model-name") == 1 and argv[-2:] == ["--served-model-name", "tiny"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


@pytest.mark.parametrize("version,plugin,plugins_env,match", [
    (None, True, None, "vLLM is not installed in this Python"),
    ("0.31.1", True, None, "vLLM 0.31.1 is installed, but ridgefill's vLLM plugin was written for vLLM 0.32.0"),
    (VLLM_VERSION, False, None, "no `ridgefill` entry point"),
    (VLLM_VERSION, True, "lora_filesystem_resolver", "VLLM_PLUGINS='lora_filesystem_resolver' leaves out"),
    (VLLM_VERSION, True, "", "VLLM_PLUGINS='' leaves out"),
], ids=["vllm-missing", "vllm-other-version", "plugin-entry-point-missing", "plugin-not-allowed",
        "no-plugin-allowed"])
def test_the_vllm_installation_is_checked_before_it_starts(version, plugin, plugins_env, match, tiny_checkpoint,
                                                           split3_maps, vllm_ok, monkeypatch, capfd):
    monkeypatch.setattr(vserving, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(vserving, "plugin_installed", lambda: plugin)
    if plugins_env is not None:
        monkeypatch.setenv("VLLM_PLUGINS", plugins_env)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--maps", split3_maps)
    assert code == 2 and "argv" not in vllm_ok
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    if version is None or version != VLLM_VERSION:
        assert "pip install 'ridgefill[vllm]'" in err


def test_the_real_lookups_agree_with_the_installation():
    from importlib.util import find_spec

    version = vserving.installed_vllm_version()
    assert (version is None) == (find_spec("vllm") is None)
    if version is not None:
        import vllm

        assert version == vllm.__version__
        assert vserving.plugin_installed(), "vLLM is installed without ridgefill's plugin entry point: reinstall ridgefill"


def test_launch_forwards_signals_to_the_child_and_returns_its_exit_code(tmp_path):
    ready = tmp_path / "ready"
    child = ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
             f"open({str(ready)!r}, 'w').write(str(os.getpgid(0)))\n"
             "time.sleep(60)\n")

    def signal_when_ready(signum):
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)  # to this process: launch forwards it

    def plan(code: str) -> serve.Launch:  # a child that never answers its health URL
        return serve.Launch([sys.executable, "-c", code], dict(os.environ), f"http://127.0.0.1:{free_port()}/health",
                            "up", tmp_path / "child.log")

    handler = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=signal_when_ready, args=(signal.SIGTERM,))
    thread.start()
    code = serve.launch(plan(child))
    thread.join()
    assert code == 7
    assert int(ready.read_text()) != os.getpgid(0)  # its own process group: a Ctrl-C reaches it once, forwarded
    assert signal.getsignal(signal.SIGTERM) is handler  # this process's own handler is back
    # a child that ends by itself before it is up: its reason, one line (no signal was forwarded)
    with pytest.raises(RidgefillError, match=r"the server could not start \(ValueError: no room\): see the log"):
        serve.launch(plan("raise ValueError('no room')"))
    with pytest.raises(RidgefillError, match="exited with code 137 before it answered"):
        serve.launch(plan("import os; os.kill(os.getpid(), 9)"))


def test_the_plugin_entry_point_serve_checks_for_is_the_one_pyproject_declares():
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {vserving.PLUGIN: vserving.PLUGIN_TARGET}


# --- bad configurations, in process -----------------------------------------------------------------------------
def unsupported_model(root: Path, tiny: dict) -> Path:
    folder = root / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return folder


def maps_of_7_layers(root: Path, tiny: dict) -> Path:
    """The llama checkpoint's maps, their metadata saying 7 layers (the checkpoint has 6)."""
    from ridgefill.runtime.artifacts import load_artifact, save_artifact

    tensors, meta = load_artifact(tiny["llama"][1], "maps")
    save_artifact(root / "maps-7.safetensors", tensors, {**meta, "n_layers": 7})
    return root / "maps-7.safetensors"


def corrupt(root: Path, tiny: dict) -> Path:
    path = root / "random.safetensors"
    path.write_bytes(random.Random(0).randbytes(4096))
    return path


def missing(root: Path, tiny: dict) -> Path:
    return root / "missing.safetensors"


BAD = [  # (id, model, maps, more arguments, the error names)
    ("maps-of-another-family", lambda root, t: t["qwen2"][0], lambda root, t: t["llama"][1], [],
     "fitted for another model"),
    ("maps-for-another-layer-count", lambda root, t: t["llama"][0], maps_of_7_layers, [],
     "holds maps for a 7-layer model"),
    ("maps-missing", lambda root, t: t["llama"][0], missing, [], "does not exist"),
    ("maps-corrupt", lambda root, t: t["llama"][0], corrupt, [], "corrupted or truncated"),
    ("unsupported-family", unsupported_model, lambda root, t: t["llama"][1], [], "unsupported architecture 'gpt2'"),
    ("tail-zero", lambda root, t: t["llama"][0], lambda root, t: t["llama"][1], ["--tail", "0"], "tail 0"),
    ("maps-for-another-split", lambda root, t: t["llama"][0], lambda root, t: t["llama"][1], ["--split", "3"],
     "holds maps for split 2, not 3"),
    ("lora", lambda root, t: t["llama"][0], lambda root, t: t["llama"][1],
     ["--max-model-len", "512", "--enable-lora"], "LoRA is not supported with RidgeFill"),
]


@pytest.mark.parametrize("model,maps,args,match", [pytest.param(*case[1:], id=case[0]) for case in BAD])
def test_a_bad_configuration_is_one_line_and_exit_2_without_starting_vllm(model, maps, args, match, vllm_tiny,
                                                                         vllm_ok, tmp_path, monkeypatch, capfd):
    """In process, through the console entry point (a launch would be recorded, and fail the test)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code, err = main(monkeypatch, capfd, "serve", "--model", model(tmp_path, vllm_tiny), "--maps",
                     maps(tmp_path, vllm_tiny), "--port", free_port(), *args)
    assert code == 2 and "argv" not in vllm_ok, err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert "Traceback" not in err and not any(cwd.iterdir())


def serving_config(path: Path, tiny: Path, maps: Path | None, split: int, weights: str | None = None) -> Path:
    from ridgefill.runtime.models import checkpoint_fingerprint
    from ridgefill.method.fill import SERVING_KIND as KIND
    from ridgefill.runtime.paths import file_sha256

    doc = {"kind": KIND, "variant": "ridge" if maps else "identity", "split": split, "tail": 12, "keep_first": 2,
           "maps": {"path": str(maps), "sha256": file_sha256(maps)} if maps else None,
           "model": {"weights_hash": weights or checkpoint_fingerprint(tiny)}}
    path.write_text(json.dumps(doc))
    return path


def test_serve_takes_a_serving_config_from_tune(tiny_checkpoint, split3_maps, vllm_ok, monkeypatch, capfd, tmp_path):
    """--serving-config sets maps, split, tail and keep-first; an identity config is served through an identity
    maps file that lives as long as the server."""
    ridge = serving_config(tmp_path / "ridge.json", tiny_checkpoint, split3_maps, 3)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--serving-config", ridge)
    assert code == 0, err
    env = vllm_ok["env"]
    assert env[ENV["maps"]] == str(split3_maps.resolve()) and env[ENV["tail"]] == "12" and env[ENV["keep_first"]] == "2"

    seen = {}

    def launch(plan):  # the identity maps file must exist while the server runs
        from ridgefill.runtime.artifacts import read_meta

        seen.update(read_meta(plan.env[ENV["maps"]], "maps"), banner=plan.banner)
        return 0

    monkeypatch.setattr(serve, "launch", launch)
    identity = serving_config(tmp_path / "identity.json", tiny_checkpoint, None, 4)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--serving-config", identity)
    assert code == 0, err
    assert seen["kind"] == "identity" and seen["split"] == 4 and "split 4 of 6 layers" in seen["banner"]


@pytest.mark.parametrize("extra, match", [
    ([], "give --maps (from ridgefill fit), --split (identity fill) or --serving-config"),
    (["--maps", "m.safetensors", "--serving-config", "s.json"], "--serving-config sets the fill"),
    (["--split", "3", "--serving-config", "s.json"], "--serving-config sets the fill"),
    (["--split", "3", "--tail", "0"], "--tail 0 must be an integer of at least 1"),
    (["--split", "3", "--outlier-factor", "nan"], "--outlier-factor nan must be 0"),
])
def test_serve_needs_maps_or_a_serving_config(extra, match, vllm_ok, monkeypatch, capfd):
    code, err = main(monkeypatch, capfd, "serve", *extra)
    assert code == 2 and err.count("\n") == 1 and match in err, err


def test_serve_refuses_a_serving_config_of_another_model(tiny_checkpoint, split3_maps, vllm_ok, monkeypatch, capfd,
                                                         tmp_path):
    other = serving_config(tmp_path / "other.json", tiny_checkpoint, split3_maps, 3, weights="0123456789abcdef")
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--serving-config", other)
    assert code == 2 and "tuned for another model" in err and "argv" not in vllm_ok, err
