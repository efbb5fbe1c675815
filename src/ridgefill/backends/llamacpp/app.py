"""The process `ridgefill serve --engine llamacpp` runs (`python -m ridgefill.backends.llamacpp.app SPEC [--guard
CLASS] [--stock]`): llama.cpp's own `llama-server`, patched (patches/server.patch: the fill per slot, llama-server's
continuous batching over `--parallel` slots), behind a small front on serve's address. SPEC is the JSON server.py
writes (the llama-server binary and its arguments, the GGUF, the maps as a GGUF adapter, the address, the admission
bound). The API key comes by the environment (serving.KEY_ENV), never a command line: the front checks it, and
llama-server, on a loopback port of its own, gets a fresh key of the front's through its environment (LLAMA_API_KEY),
so nothing on this machine reaches it past the front.

The front: outermost the request guard (`--guard`: the API key before any body, body limits), then `Admission`
(admission.py: a request admitted once its whole body has come and passed its checks, requests.py; at most `queue`
at once, past that a 503; a client that goes away has its request to llama-server closed, which stops its work there)
and the proxy to llama-server (`Proxy`: every answer streamed as llama-server sends it; an error's message made one
line). /health answers once llama-server does; /metrics is llama-server's (RidgeFill's counters among them:
ridgefill_filled_tokens_total, ...) and the admission gauge. `--stock`: the same llama-server without --ridgefill
and without the guard: bench-serve's baseline. The port is bound before llama-server starts: one taken is one line
(RidgefillError's, which serve prints as its reason). llama-server's own lines go to this process's output (serve's
log); one that did not start is one line naming its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque

from ridgefill.backends.llamacpp import requests
from ridgefill.backends.llamacpp.admission import Admission, Queue, answer, body_limit
from ridgefill.backends.llamacpp.server import KEY_ENV
from ridgefill.backends.serving import free_port
from ridgefill.errors import RidgefillError

GRACE_S = 5  # seconds SIGTERM waits for running requests before the server closes them
START_S = 600  # seconds llama-server may take to load a model
CHILD_KEY_ENV = "LLAMA_API_KEY"  # llama-server's API key from its environment (common/arg.cpp: --api-key's env)
# llama-server's log lines that say why it did not start (the last one seen is the reason shown)
REASONS = ("ridgefill: ", "failed to load ridgefill adapter: ", "error while handling argument", "error: ",
           "failed to load model", "failed to create_context", "couldn't bind")
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server", b"date"}


class Child:
    """llama-server as a child process: its output copied to ours line by line (the last lines that name an error
    kept), stopped with the front (SIGTERM, then SIGKILL after GRACE_S), and given SIGTERM by the kernel should the
    front die first."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.reasons: deque[str] = deque(maxlen=4)
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.copier = threading.Thread(target=self.copy, daemon=True)
        self.copier.start()

    def copy(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            reason = next((line[line.index(r):] for r in REASONS if r in line), None)
            if reason:
                self.reasons.append(reason)

    def reason(self) -> str:
        """Why it ended: its last line naming an error, or its exit code."""
        self.copier.join(5)
        return self.reasons[-1] if self.reasons else f"it exited with code {self.proc.returncode}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def die_with_parent() -> None:
    """In the child: SIGTERM when the front dies (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def wait_ready(child: Child, base: str, key: str) -> dict:
    """Wait for llama-server's /health, then read its model's facts (/v1/models' meta: n_vocab); RidgefillError, one
    line, when it ends first."""
    deadline = time.monotonic() + START_S
    while True:
        if child.proc.poll() is not None:
            raise RidgefillError(f"llama-server did not start: {child.reason()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        if time.monotonic() > deadline:
            raise RidgefillError(f"llama-server did not answer in {START_S} s: see the log")
        time.sleep(0.1)
    ask = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(ask, timeout=30) as r:
        models = json.load(r)
    return (models.get("data") or [{}])[0].get("meta") or {}


class Proxy:
    """An ASGI app forwarding each request to llama-server (its internal key added), its answer streamed back as
    it comes; an error's message made one line (never a traceback or an internal path)."""

    def __init__(self, base: str, key: str) -> None:
        import httpx

        self.key = key
        self.client = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None, connect=10.0))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"host", b"authorization",
                                                                                     b"content-length")]
        headers.append((b"authorization", f"Bearer {self.key}".encode()))
        path = scope.get("raw_path") or scope["path"].encode()
        url = path.decode("latin-1") + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string")
                                        else "")
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        response = await self.client.send(request, stream=True)
        try:
            if response.status_code >= 400:
                await self.error(send, response)
                return
            kept = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP]
            await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    @staticmethod
    async def error(send, response) -> None:
        """llama-server's error as one line, in the OpenAI format, with its status (501, a feature this server was not
        started with, is the client's 400)."""
        text = (await response.aread()).decode(errors="replace")
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text
        status = 400 if response.status_code == 501 else response.status_code
        await answer(send, status, requests.one_line(str(message) or f"llama-server answered {status}"))


def build_app(spec: dict, child_base: str, child_key: str, meta: dict, guard: str | None, stock: bool):
    """The front: the guard (when named), Admission, /health, /metrics, the proxy."""
    proxy = Proxy(child_base, child_key)
    queue = Queue(spec["queue"])
    model = requests.Model(int(meta.get("n_vocab") or 0), spec["name"])

    async def app(scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope.get("type") == "http" and path == "/metrics":
            upstream = await proxy.client.get("/metrics", headers={"Authorization": f"Bearer {child_key}"})
            text = (upstream.text if upstream.status_code == 200 else "") + queue.text()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            await send({"type": "http.response.body", "body": text.encode()})
            return
        if scope.get("type") == "http" and path == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type",
                                                                                   b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
            return
        await proxy(scope, receive, send)

    front = Admission(app, queue=queue, fill_on=not stock, model=model, limit=body_limit())
    if guard:
        module, _, middleware = guard.rpartition(".")
        return getattr(importlib.import_module(module), middleware)(front)
    return front


def child_argv(spec: dict, port: int, stock: bool) -> list[str]:
    """llama-server's command: the GGUF, its name, context, batch, threads, slots, an F16 K/V cache, flash
    attention, /metrics, and with the fill the adapter and the fill's settings."""
    argv = [spec["binary"], "-m", spec["gguf"], "--alias", spec["name"], "--host", "127.0.0.1", "--port", str(port),
            "-c", str(spec["n_ctx"] * spec["parallel"]), "-np", str(spec["parallel"]), "-b", str(spec["n_batch"]),
            "-ub", str(spec["n_ubatch"]), "-t", str(spec["threads"]), "-tb", str(spec["threads"]), "-fa", "on",
            "-ctk", "f16", "-ctv", "f16", "--metrics", "--no-webui", "--cache-ram", "0", "--no-warmup"]
    fill = spec.get("fill")
    if fill and not stock:
        argv += ["--ridgefill", fill["adapter"], "--ridgefill-tail", str(fill["tail"]), "--ridgefill-keep-first",
                 str(fill["keep_first"]), "--ridgefill-outlier-factor", repr(float(fill["outlier_factor"]))]
    return argv


# --- the process ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ridgefill.backends.llamacpp.app")
    parser.add_argument("spec")
    parser.add_argument("--guard", default=None)
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args(argv)
    child = None
    try:
        with open(args.spec) as f:
            spec = json.load(f)
        sock = listening(spec["host"], spec["port"])  # before llama-server starts: a taken port ends the start
        port, child_key = free_port(), secrets.token_hex(16)
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV} | {CHILD_KEY_ENV: child_key}
        child = Child(child_argv(spec, port, args.stock), env)
        base = f"http://127.0.0.1:{port}"
        meta = wait_ready(child, base, child_key)
        app = build_app(spec, base, child_key, meta, args.guard, args.stock)
    except RidgefillError as exc:  # the front prints it as serve's one line (serve/process.startup_error)
        print(f"ridgefill.errors.RidgefillError: {exc}", flush=True)
        if child is not None:
            child.stop()
        return 2
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # a stop asked for is a clean exit (0), not uvicorn's signal raised again (143)
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    ended = []  # llama-server's end while the front served (the front then ends with exit code 1)

    async def watch_child(server: Server) -> None:
        while child.proc.poll() is None and not server.should_exit:
            await asyncio.sleep(0.5)
        if child.proc.poll() is not None and not server.should_exit:
            print(f"ridgefill.errors.RidgefillError: llama-server ended: {child.reason()}", flush=True)
            ended.append(child.proc.returncode)
            server.should_exit = True

    config = uvicorn.Config(app, log_level="info", timeout_keep_alive=5, timeout_graceful_shutdown=GRACE_S)
    server = Server(config)

    async def serve() -> None:
        watcher = asyncio.ensure_future(watch_child(server))
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()

    try:
        asyncio.run(serve())
    finally:
        child.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if ended else 0)


def listening(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (as uvicorn binds it); RidgefillError, one line, when the port is
    taken (something took it after serve's check: uvicorn would log it and exit with code 3, the reason lost)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise RidgefillError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port, or stop "
                             "what uses it") from None
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
