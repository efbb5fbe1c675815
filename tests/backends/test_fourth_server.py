"""The serving seam seen from outside: a fourth serving engine (tests/backends/fourth_engine/server.py: a Server whose
OpenAI-compatible server is a tiny one of the test's own, app.py) added by one line in backends.ENGINES and one in
backends.SERVERS runs `ridgefill serve` and `ridgefill bench-serve` as vLLM and llama.cpp do: the fill resolved and
checked by the front, the request guard in its dialect, the banner, /metrics checked for RidgeFill, failures read in
its own dialect and named by its title, the stock baseline as its launch without a fill, and bench-serve's result
naming the engine and its build."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port
from ridgefill import backends
from ridgefill.commands import command
from ridgefill.errors import RidgefillError

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = Path(__file__).resolve().parent
PROMPT = "the grass is green and the sky is blue, here we go there and back again " * 2
# `ridgefill serve` with the fourth engine in the registry, as a new engine's one line would put it there
LAUNCHER = ("import sys; from ridgefill import backends; "
            "backends.ENGINES['fourth'] = ('fourth_engine.backend', 'a test engine'); "
            "backends.SERVERS['fourth'] = ('fourth_engine.server', '--context N'); "
            "from ridgefill.cli import main; sys.argv[0] = 'ridgefill'; main()")


@pytest.fixture
def fourth(monkeypatch):
    monkeypatch.setitem(backends.ENGINES, "fourth", ("fourth_engine.backend", "a test's fourth engine"))
    monkeypatch.setitem(backends.SERVERS, "fourth", ("fourth_engine.server", "--context N"))
    return backends.server_of("fourth")


def serve(args: list[str], env: dict) -> subprocess.Popen:
    paths = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, "serve", "--engine", "fourth", *args],
                            env={**os.environ, "PYTHONPATH": paths, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def banner(proc: subprocess.Popen, seconds: float = 300) -> str:
    """serve's line once the server is up (stderr's first line that starts with `ridgefill serve:`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if line.startswith("ridgefill serve:") or (not line and proc.poll() is not None):
            return line
    pytest.fail("serve did not come up")


def test_a_fourth_serving_engine_runs_serve_through_the_seam(fourth, tiny_checkpoint, tmp_path):
    from openai import OpenAI

    key, port = secrets.token_hex(8), free_port()
    proc = serve(["--model", str(tiny_checkpoint), "--split", "3", "--tail", "8", "--port", str(port),
                  "--log-file", str(tmp_path / "fourth.log")], {"FOURTH_API_KEY": key})
    try:
        line = banner(proc)
        assert line.startswith(f"ridgefill serve: {tiny_checkpoint} through Fourth at http://127.0.0.1:{port}/v1 with "
                               "RidgeFill: identity fill, maps identity (split 3 of 6 layers), tail 8"), line
        assert "one request at a time" in line and str(tmp_path / "fourth.log") in line
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) as client:
            text = client.completions.create(model=str(tiny_checkpoint), prompt=PROMPT, max_tokens=5,
                                             temperature=0).choices[0].text
        alone = command("generate")(model=str(tiny_checkpoint), engine="torchfill", split=3, tail=8, prompt=PROMPT,
                                    max_new_tokens=5)
        assert text == alone["filled"]  # the fill the front resolved is the one the engine's server ran
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as denied:  # the guard, in the fourth engine's dialect
            opener.open(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"{}"), timeout=30)
        assert denied.value.code == 401
        with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert any(m.startswith("ridgefill_filled_tokens_total") and float(m.split()[1]) > 0
                       for m in r.read().decode().splitlines())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM  # uvicorn re-raises it once shut down; serve exits as its server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("env, line", [
    ({"FOURTH_FAIL": "no room for the model"},
     "error: the server could not start (FourthError: no room for the model): give the fourth engine more room"),
    ({"FOURTH_NO_COUNTERS": "1"},
     "error: Fourth's server came up without RidgeFill: its /metrics has no ridgefill_filled_tokens_total, so "
     "RidgeFill did not load in it and every ridgefill_* option would be ignored; it was stopped: install the fourth "
     "engine's RidgeFill, and see the server's log,"),
])
def test_a_fourth_engines_failure_is_one_line_in_its_own_words(env, line, fourth, tiny_checkpoint, tmp_path):
    proc = serve(["--model", str(tiny_checkpoint), "--split", "3", "--port", str(free_port()),
                  "--log-file", str(tmp_path / "fourth.log")], env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert "vLLM" not in err and "llama" not in err


def test_a_fourth_engine_refuses_what_it_does_not_run_before_starting(fourth, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr("ridgefill.serve.serve.launch", lambda plan: pytest.fail("serve would start a server"))
    with pytest.raises(RidgefillError, match="^the drop variant is not supported with --engine fourth: use exact, "):
        command("serve")(model=str(tiny_checkpoint), engine="fourth",
                         serving_config=_drop_config(tiny_checkpoint, tmp_path))
    with pytest.raises(RidgefillError, match="^--filled-window is not supported with --engine fourth: drop it$"):
        command("serve")(model=str(tiny_checkpoint), engine="fourth", split=3, filled_window=16)
    with pytest.raises(RidgefillError, match="^--max-model-len 9: the fourth engine's server takes --context N only$"):
        command("serve")(model=str(tiny_checkpoint), engine="fourth", split=3, server_args=["--max-model-len", "9"])


def _drop_config(model: Path, tmp_path: Path) -> Path:
    from ridgefill.method.fill import SERVING_KIND, FillSettings
    from ridgefill.runtime.models import model_identity

    path = tmp_path / "drop.json"
    path.write_text(json.dumps({"kind": SERVING_KIND, "version": 2,
                                "model": {"weights_hash": model_identity(str(model)).info["weights_hash"]},
                                **FillSettings("drop", 3, None).to_serving()}))
    return path


def test_bench_serve_runs_a_fourth_engines_filled_and_stock_servers(fourth, tiny_checkpoint, long_docs, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    out = tmp_path / "bench.json"
    doc = command("bench-serve")(model=str(tiny_checkpoint), engine="fourth", split=3, tail=8, data=str(long_docs),
                                 rates="2,4", requests=3, prompt_tokens=24, output_tokens=3, out=out)
    assert json.loads(out.read_text()) == doc
    assert doc["engine"]["name"] == "fourth" and doc["engine"]["build"] == backends.backend_class("fourth").provenance()
    assert doc["config"]["engine"] == "fourth" and doc["config"]["server_args"] == []
    assert {(r["variant"], r["rate"]) for r in doc["results"]} == {(v, r) for v in ("exact", "ridge") for r in (2, 4)}
    assert all(r["requests"] == 3 and r["ttft_p50_s"] > 0 for r in doc["results"])
    ridge, stock = doc["servers"]["ridge"]["argv"], doc["servers"]["exact"]["argv"]
    assert "--guard" in ridge and "--guard" not in stock and stock[-1].endswith("fourth-stock.json")
    assert Path(f"{out}.png").is_file()
