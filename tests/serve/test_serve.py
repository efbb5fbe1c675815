"""`ridgefill serve`: the vLLM server with RidgeFill answers OpenAI completion requests (per-request tail included),
and every bad configuration is one line on stderr and exit code 2 before any vLLM process starts.

The server tests need vLLM (the `vllm_tiny` fixture skips without it); the checks of the vLLM installation and the
command line handed to vLLM replace the lookups and the launch in-process, so they run everywhere."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ridgefill import cli
from ridgefill.serve import serve
from ridgefill.serve.vllm_config import ENV, VLLM_VERSION
from tiny_checkpoint import write_corpus
from vllm_fixtures import vllm_tiny  # noqa: F401  (fixture: tiny checkpoints vLLM can serve, with maps)

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
START_TIMEOUT = 300.0  # seconds for vLLM to load a tiny model on a busy 2-core machine (~40 s when quiet)


# --- in-process: what serve hands to vLLM, and the vLLM installation's checks ---------------------------------
@pytest.fixture(scope="module")
def fitted(tiny_checkpoint, tmp_path_factory) -> Path:
    """Maps fitted on the tiny checkpoint (split 3)."""
    from ridgefill.commands import command

    root = tmp_path_factory.mktemp("serve-maps")
    text = write_corpus(root / "text.txt", seed=3, lines_per_document=12)
    command("calibrate")(model=str(tiny_checkpoint), data=str(text), split="3", tokens=1024, seq_len=128,
                         holdout=0.25, out=root / "stats.safetensors")
    command("fit")(stats=root / "stats.safetensors", split=3, out=root / "maps.safetensors")
    return root / "maps.safetensors"


@pytest.fixture
def vllm_ok(monkeypatch):
    """The installation checks pass; launch records (argv, env) and returns `launched["code"]`."""
    launched = {"code": 0}

    def launch(argv, env):
        launched.update(argv=argv, env=env)
        return launched["code"]

    monkeypatch.setattr(serve, "installed_vllm_version", lambda: VLLM_VERSION)
    monkeypatch.setattr(serve, "plugin_installed", lambda: True)
    monkeypatch.setattr(serve, "launch", launch)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    return launched


def main(monkeypatch, capfd, *args) -> tuple[int, str]:
    """`ridgefill ARGS` through the console entry point: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["ridgefill", *map(str, args)])
    capfd.readouterr()
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capfd.readouterr().err


def test_serve_runs_the_vllm_server_with_the_fill_and_hands_on_undeclared_options(
        tiny_checkpoint, fitted, vllm_ok, monkeypatch, capfd):
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--maps", fitted, "--tail", 16,
                     "--max-model-len", 256, "-tp", 1, "--max_num_seqs=4", "--port", 8123, "--seed", 3,
                     "--no-enable-log-requests")
    assert code == 0, err
    folder = str(tiny_checkpoint)
    assert vllm_ok["argv"] == [
        sys.executable, "-m", serve.VLLM_SERVER, "--model", folder, "--served-model-name", folder,
        "--host", "127.0.0.1", "--port", "8123", "--dtype", "float32", "--no-enable-prefix-caching",
        "--enforce-eager", "--max-model-len", "256", "-tp", "1", "--max_num_seqs=4", "--seed", "3",
        "--no-enable-log-requests"]
    env = vllm_ok["env"]
    assert env[ENV["maps"]] == str(fitted.resolve()) and env[ENV["tail"]] == "16"
    assert env[ENV["keep_first"]] == "1" and float(env[ENV["outlier_factor"]]) == 20.0
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is inherited
    assert err.count("\n") == 1 and err.startswith("ridgefill serve: ") and "split 3 of 6 layers" in err


def test_serve_exits_with_the_servers_exit_code_and_a_served_name_given_is_kept(
        tiny_checkpoint, fitted, vllm_ok, monkeypatch, capfd):
    vllm_ok["code"] = 3
    code, _ = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--maps", fitted, "--dtype", "bf16",
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
                                                           fitted, vllm_ok, monkeypatch, capfd):
    monkeypatch.setattr(serve, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(serve, "plugin_installed", lambda: plugin)
    if plugins_env is not None:
        monkeypatch.setenv("VLLM_PLUGINS", plugins_env)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--maps", fitted)
    assert code == 2 and "argv" not in vllm_ok
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    if version is None or version != VLLM_VERSION:
        assert "pip install 'ridgefill[vllm]'" in err


def test_the_real_lookups_agree_with_the_installation():
    from importlib.util import find_spec

    version = serve.installed_vllm_version()
    assert (version is None) == (find_spec("vllm") is None)
    if version is not None:
        import vllm

        assert version == vllm.__version__


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

    handler = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=signal_when_ready, args=(signal.SIGTERM,))
    thread.start()
    code = serve.launch([sys.executable, "-c", child], dict(os.environ))
    thread.join()
    assert code == 7
    assert int(ready.read_text()) != os.getpgid(0)  # its own process group: a Ctrl-C reaches it once, forwarded
    assert signal.getsignal(signal.SIGTERM) is handler  # this process's own handler is back
    assert serve.launch([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], dict(os.environ)) == 137


# --- the server, end to end -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_until_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ridgefill serve exited ({proc.returncode}) before answering:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    pytest.fail(f"ridgefill serve did not answer {url} within {START_TIMEOUT:.0f} s:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ridgefill serve (it forwards it to vLLM); after 60 s SIGKILL to it and to vLLM's process group."""
    children = []
    try:
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except OSError:
        pass
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        for pid in children:  # vLLM's API server leads its own process group (engine core and workers in it)
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def exact_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """Under transformers' forward of the checkpoint: the log-prob of each of `tokens` after `prompt` and what
    came before it, and the largest log-prob at that step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits.double(), -1)
    return ([float(logp[i, t]) for i, t in enumerate(tokens)], [float(v) for v in logp.max(-1).values])


def test_the_plugin_entry_point_serve_checks_for_is_the_one_pyproject_declares():
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {serve.PLUGIN: serve.PLUGIN_TARGET}


def test_serve_answers_completions_and_a_request_can_set_its_tail(vllm_tiny, tmp_path):
    if not serve.plugin_installed():
        pytest.skip("ridgefill's vllm.general_plugins entry point is not installed here (an install older than "
                    "the plugin): reinstall ridgefill")
    folder, maps = vllm_tiny["llama"]
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([*RIDGEFILL, "serve", "--model", str(folder), "--maps", str(maps), "--tail", "16",
                                 "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "4"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(proc, f"{base}/health", log)
        assert tail(log, 10**6).splitlines()[0].startswith("ridgefill serve: ")
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [str(folder)]
        prompt = [random.Random(0).randrange(3, 500) for _ in range(120)]  # 120 tokens: 103 filled at tail 16
        request = {"model": str(folder), "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                   "logprobs": 1, "return_token_ids": True}
        answers = {}
        for name, extra in [("filled", {}), ("exact", {"vllm_xargs": {"ridgefill_tail": 10000}})]:
            status, body = post(f"{base}/v1/completions", {**request, **extra})
            assert status == 200, body
            (choice,) = body["choices"]
            assert len(choice["token_ids"]) == 4 and body["usage"]["prompt_tokens"] == len(prompt)
            answers[name] = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
        status, body = post(f"{base}/v1/completions", {"model": str(folder), "prompt": "The grass is green.",
                                                       "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
    finally:
        stop(proc)
    # a tail covering the prompt is exact prefill: transformers' own forward gives the same log-probs, and every
    # chosen token is its greedy choice
    tokens, logprobs = answers["exact"]
    expected, best = exact_logprobs(folder, prompt, tokens)
    assert logprobs == pytest.approx(expected, abs=1e-3)
    assert expected == pytest.approx(best, abs=1e-3)
    # at the served tail of 16 most rows are filled from the maps: RidgeFill ran, so the log-probs differ
    filled_tokens, filled_logprobs = answers["filled"]
    assert filled_tokens != tokens or filled_logprobs != pytest.approx(logprobs, abs=1e-4)
    assert proc.returncode == 0, tail(log)  # vLLM shut down on the forwarded SIGTERM


# --- bad configurations, end to end ---------------------------------------------------------------------------
def unsupported_model(root: Path, tiny: dict) -> Path:
    folder = root / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return folder


def more_layers(root: Path, tiny: dict) -> Path:
    """The llama checkpoint's weights (same hash) with a config.json that says 7 layers."""
    folder = root / "llama-7"
    shutil.copytree(tiny["llama"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    return folder


def corrupt(root: Path, tiny: dict) -> Path:
    path = root / "random.safetensors"
    path.write_bytes(random.Random(0).randbytes(4096))
    return path


def missing(root: Path, tiny: dict) -> Path:
    return root / "missing.safetensors"


BAD = [  # (id, model, maps, more arguments, the error names)
    ("maps-of-another-family", lambda root, t: t["qwen2"][0], lambda root, t: t["llama"][1], [],
     "fitted for another model"),
    ("maps-for-another-layer-count", more_layers, lambda root, t: t["llama"][1], [], "6-layer model"),
    ("maps-missing", lambda root, t: t["llama"][0], missing, [], "does not exist"),
    ("maps-corrupt", lambda root, t: t["llama"][0], corrupt, [], "corrupted or truncated"),
    ("unsupported-family", unsupported_model, lambda root, t: t["llama"][1], [], "GPT2LMHeadModel"),
    ("tail-zero", lambda root, t: t["llama"][0], lambda root, t: t["llama"][1], ["--tail", "0"], "tail 0"),
    ("maps-for-another-split", lambda root, t: t["llama"][0], lambda root, t: t["llama"][1], ["--split", "3"],
     "holds maps for split 2, not 3"),
    ("prefix-caching", lambda root, t: t["llama"][0], lambda root, t: t["llama"][1],
     ["--max-model-len", "512", "--enable-prefix-caching"], "prefix caching off"),
]


@pytest.mark.parametrize("model,maps,args,match", [pytest.param(*case[1:], id=case[0]) for case in BAD])
def test_a_bad_configuration_is_one_line_and_exit_2_without_starting_vllm(model, maps, args, match, vllm_tiny,
                                                                         tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = subprocess.run([*RIDGEFILL, "serve", "--model", str(model(tmp_path, vllm_tiny)), "--maps",
                        str(maps(tmp_path, vllm_tiny)), "--port", str(free_port()), *args],
                       capture_output=True, text=True, timeout=300, cwd=cwd)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and match in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not any(cwd.iterdir())


def serving_config(path: Path, tiny: Path, maps: Path | None, split: int, weights: str | None = None) -> Path:
    from ridgefill.runtime.models import checkpoint_fingerprint
    from ridgefill.runtime.serving import KIND

    doc = {"kind": KIND, "variant": "ridge" if maps else "identity", "split": split, "tail": 12, "keep_first": 2,
           "maps": str(maps) if maps else None, "model": {"weights_hash": weights or checkpoint_fingerprint(tiny)}}
    path.write_text(json.dumps(doc))
    return path


def test_serve_takes_a_serving_config_from_tune(tiny_checkpoint, fitted, vllm_ok, monkeypatch, capfd, tmp_path):
    """--serving-config sets maps, split, tail and keep-first; an identity config is served through an identity
    maps file that lives as long as the server."""
    ridge = serving_config(tmp_path / "ridge.json", tiny_checkpoint, fitted, 3)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--serving-config", ridge)
    assert code == 0, err
    env = vllm_ok["env"]
    assert env[ENV["maps"]] == str(fitted.resolve()) and env[ENV["tail"]] == "12" and env[ENV["keep_first"]] == "2"

    seen = {}

    def launch(argv, env):  # the identity maps file must exist while the server runs
        from ridgefill.runtime.artifacts import read_meta

        seen.update(read_meta(env[ENV["maps"]], "maps"))
        return 0

    monkeypatch.setattr(serve, "launch", launch)
    identity = serving_config(tmp_path / "identity.json", tiny_checkpoint, None, 4)
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--serving-config", identity)
    assert code == 0, err
    assert seen["kind"] == "identity" and seen["split"] == 4 and "split 4 of 6 layers" in err


@pytest.mark.parametrize("extra, match", [
    ([], "give exactly one of --maps"),
    (["--maps", "m.safetensors", "--serving-config", "s.json"], "give exactly one of --maps"),
])
def test_serve_needs_maps_or_a_serving_config(extra, match, vllm_ok, monkeypatch, capfd):
    code, err = main(monkeypatch, capfd, "serve", *extra)
    assert code == 2 and err.count("\n") == 1 and match in err, err


def test_serve_refuses_a_serving_config_of_another_model(tiny_checkpoint, fitted, vllm_ok, monkeypatch, capfd,
                                                         tmp_path):
    other = serving_config(tmp_path / "other.json", tiny_checkpoint, fitted, 3, weights="0123456789abcdef")
    code, err = main(monkeypatch, capfd, "serve", "--model", tiny_checkpoint, "--serving-config", other)
    assert code == 2 and "tuned for another model" in err and "argv" not in vllm_ok, err
