"""A real `ridgefill serve --engine llamacpp` for the server tests (test_server*.py): started as a user starts it, its
stderr read up to serve's line saying what it serves and never again (the log relay must keep reading the server's
output), requests over loopback, stopped with SIGTERM; perturbed maps for the tiny GGUFs (a wrong fill shows)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from server_client import ServerClient

RIDGEFILL = [sys.executable, "-m", "ridgefill"]
START_TIMEOUT = 180.0


def perturbed_maps(gguf: Path, out: Path, split: int = 3, seed: int = 0, scale: float = 0.2) -> Path:
    """Ridge maps for the tiny GGUF's conversion: the identity plus noise and a random bias, so filled rows differ
    from exact ones and from identity fill."""
    import torch

    from ridgefill.method.maps import save_maps
    from ridgefill.method.ridge import LayerFit
    from ridgefill.runtime.models import model_identity

    identity = model_identity(str(gguf))
    info, layers, h = identity.info, identity.shape.layers, identity.shape.hidden
    g = torch.Generator().manual_seed(seed)
    fits = [LayerFit(layer=l, lam=1.0, weight=torch.eye(h) + scale * torch.randn(h, h, generator=g) / h ** 0.5,
                     bias=scale * torch.randn(h, generator=g), low_rank=None, error_identity=1.0, error_map=0.5,
                     error_full_rank=0.5) for l in range(split + 1, layers)]
    save_maps(out, split, layers, fits, {"model": info}, "ridge")
    return out


@dataclass
class Served(ServerClient):
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    key: str
    log: Path
    banner: str
    name: str  # the model name it serves under (serve's --model, a path's stem)


def read_until_banner(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in iter(proc.stderr.readline, b""):
        lines.append(line.decode(errors="replace"))
        if line.startswith(b"ridgefill serve: "):
            return


def start(args: list[str], root: Path, key: str, env: dict | None = None, name: str | None = None) -> Served:
    """`ridgefill serve --engine llamacpp ARGS --port P --log-file L`, its key in the environment, up and checked."""
    from helpers import free_port

    port, log = free_port(), root / f"serve-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([*RIDGEFILL, "serve", "--engine", "llamacpp", *args, "--port", str(port), "--log-file",
                             str(log), "--api-key", key], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    lines: list[str] = []
    reader = threading.Thread(target=read_until_banner, args=(proc, lines), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT)
    if not lines or not lines[-1].startswith("ridgefill serve: "):
        stop(proc)
        raise AssertionError(f"serve did not come up ({proc.poll()}):\n{''.join(lines)[-3000:]}\n{tail(log)}")
    from ridgefill.backends.serving import served_name

    model = args[args.index("--model") + 1]
    return Served(proc, f"http://127.0.0.1:{port}", key, log, lines[-1], name or served_name(model))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


def stream_open(server: Served, body: dict) -> tuple[socket.socket, bytes]:
    """A streamed completion whose first event has come: (its open socket, what was read)."""
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port()), timeout=60)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {server.key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while b"data: {" not in got:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return s, got
