"""One real `ridgefill serve` with vLLM for the whole test session (`vllm_server`, registered in conftest.py): the
embedded SmolLM2 from the serving config `ridgefill tune` wrote, serve's defaults otherwise (compiled, prefix caching
on), its API key in VLLM_API_KEY, its stderr a pipe read up to serve's line and never again. Its tests
(tests/backends/vllm/test_vllm_server.py, then the conformance suite's vLLM cases, tests/serve/conformance) share one
pytest-xdist group, `vllm-server` (conftest.py), so the server starts once; the conformance suite's last vLLM test
stops it with SIGTERM, and a test that runs after that (the order within a group follows the command line) gets a new
one (`Servers.get`)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
START_TIMEOUT = 300.0  # seconds for vLLM to load a tiny model on a busy 2-core machine (~40 s when quiet)
GROUP = "vllm-server"  # the pytest-xdist group of every test that uses vllm_server


@dataclass
class Server:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    log: Path  # vLLM's log (--log-file): every line of its output, whether stderr took it or not
    banner: str  # serve's line saying what it serves, the last line read from its stderr
    maps: Path  # the maps file it serves (named by the serving config; a test changes it while it serves)
    folder: Path  # the checkpoint folder
    key: str  # its API key (VLLM_API_KEY in serve's environment)
    config: Path  # the serving config it serves

    def get(self, path: str, key: str | None = None) -> tuple[int, bytes]:
        """GET `path`, with `key` as the bearer token if given: (status, body)."""
        request = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


def read_until_banner(proc: subprocess.Popen, lines: list[str]) -> None:
    """serve's stderr into `lines` up to its line saying what it serves; after that, nobody reads it."""
    for line in iter(proc.stderr.readline, b""):
        lines.append(line.decode(errors="replace"))
        if line.startswith(b"ridgefill serve: "):
            return


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


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ridgefill serve (it forwards it to vLLM); after 60 s SIGKILL to it and to vLLM's process group."""
    if proc.poll() is not None:
        return
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


class Servers:
    """The session's vLLM server: `get()` gives the running one, or starts one (the first time, or after a test
    stopped it)."""

    def __init__(self, smollm2_tuned, tmp_path_factory) -> None:
        self.tuned, self.tmp_path_factory, self.server = smollm2_tuned, tmp_path_factory, None

    def get(self) -> Server:
        if self.server is None or self.server.proc.poll() is not None:
            self.server = start(*self.tuned, self.tmp_path_factory.mktemp("server"))
        return self.server

    def close(self) -> None:
        if self.server is not None:
            stop(self.server.proc)


def start(folder: Path, config: Path, root: Path) -> Server:
    """`ridgefill serve --model smollm2-135m --serving-config S --port P`, S the serving config `ridgefill tune` wrote
    (ridge, split 15, tail 64): nothing else, no KV cache setting in the environment either (serve's defaults must
    start on this machine), and an API key in VLLM_API_KEY. Where vLLM is installed and the plugin's entry point is
    not, the tests fail: a broken install must not pass as a skip."""
    from helpers import free_port
    from ridgefill.backends.vllm import server as vserving
    from ridgefill.method.fill import load_serving

    assert vserving.plugin_installed(), ("ridgefill's vllm.general_plugins entry point is not installed beside vLLM: "
                                         "reinstall ridgefill (pip install -e '.[vllm]')")
    port, log = free_port(), root / "vllm.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS")}
    key = secrets.token_hex(16)
    proc = subprocess.Popen([*RIDGEFILL, "serve", "--model", "smollm2-135m", "--serving-config", str(config),
                             "--port", str(port), "--log-file", str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root,
                            env={**env, "TOKENIZERS_PARALLELISM": "false", "VLLM_API_KEY": key})
    stderr: list[str] = []
    reader = threading.Thread(target=read_until_banner, args=(proc, stderr), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, f"{base}/health", log)
        reader.join(30)  # serve prints its line just after vLLM answers
        assert stderr and stderr[-1].startswith("ridgefill serve: "), "".join(stderr)[-3000:] + tail(log)
    except BaseException:
        stop(proc)
        raise
    return Server(proc, base, log, stderr[-1], load_serving(config).fill.maps, folder, key, config)


@pytest.fixture(scope="session")
def vllm_server(smollm2_tuned, tmp_path_factory):
    """The session's vLLM server (Servers: `.get()`), stopped at the end."""
    servers = Servers(smollm2_tuned, tmp_path_factory)
    try:
        yield servers
    finally:
        servers.close()
