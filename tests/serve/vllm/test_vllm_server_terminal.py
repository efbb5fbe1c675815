"""`ridgefill serve` as a user runs it with a terminal that does not keep up (`ridgefill serve ... 2>&1 | less` left
unscrolled, Ctrl-S): its stderr is a pipe that nobody reads once the server is up. uvicorn logs every request (one
line of about 80 bytes for GET /health): a relay that echoed with blocking writes stalled once the pipe held 64 KiB,
vLLM's own output pipe filled behind it, and vLLM blocked in its next log line (the server stopped answering without
exiting; measured with the old relay: request 2,242 of a bare GET /health). The server must answer past that many
log bytes, and its log file must hold every line. Each request here carries a 4 KiB query string, which uvicorn's
access line repeats, so the pipes fill in tens of requests rather than thousands; the server runs eagerly, as
compilation has nothing to do with its log."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from helpers import free_port

from ridgefill.serve.process import stop

pytest.importorskip("vllm")

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
START_TIMEOUT = 300.0  # seconds for vLLM to load a tiny model on a busy 2-core machine
PIPES = 2 * (64 << 10)  # stderr's pipe and vLLM's output pipe: what a blocking echo let through before vLLM blocked
PAST = 2 * PIPES  # log bytes the server must write, and answer through, after its banner
PAD = "x" * 4096  # a query string /health ignores and uvicorn's access line repeats


def test_a_server_whose_stderr_nobody_reads_keeps_answering(tmp_path):
    port, log = free_port(), tmp_path / "vllm.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_PLUGINS", "VLLM_API_KEY")}
    proc = subprocess.Popen([*RIDGEFILL, "serve", "--model", "smollm2-135m", "--split", "15", "--port", str(port),
                             "--log-file", str(log), "--max-model-len", "512", "--enforce-eager"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=tmp_path, env={**env, "TOKENIZERS_PARALLELISM": "false"},
                            start_new_session=True)
    banner = []

    def read_banner():  # read stderr up to serve's line, then never again
        for line in iter(proc.stderr.readline, b""):
            if line.startswith(b"ridgefill serve: "):
                banner.append(line)
                return

    reader = threading.Thread(target=read_banner, daemon=True)
    reader.start()
    try:
        reader.join(START_TIMEOUT)
        assert banner, f"ridgefill serve did not come up (exit code {proc.poll()}):\n{log.read_text()[-3000:]}"
        start = log.stat().st_size
        answered = 0
        while log.stat().st_size - start < PAST:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health?pad={PAD}", timeout=30) as r:
                    assert r.status == 200
            except OSError as exc:
                pytest.fail(f"request {answered + 1} got no answer ({exc}) after {answered} answered and "
                            f"{log.stat().st_size - start:,} bytes of vLLM's log since serve's banner")
            answered += 1
        print(f"{answered} requests answered, {log.stat().st_size - start:,} log bytes since the banner")
        assert proc.poll() is None and log.read_bytes().count(f'"GET /health?pad={PAD} HTTP/1.1" 200'.encode()) >= answered
    finally:
        stop(proc)  # SIGTERM to serve's process group (serve forwards it to vLLM), SIGKILL after a grace period
