"""`ridgefill serve` as a process, engine-neutral: the launch machinery (serve/process.py) runs a stand-in child, a
small HTTP server that writes as much output as asked. What is checked: the server's output is read to its end
whatever happens to stderr or the log file; a log file that cannot be written is one line before the server starts;
the default log is private and bounded; a server that comes up without RidgeFill is stopped with one line in its
engine's words; the start-up checks go through no proxy. vLLM's own plan: tests/backends/vllm/test_vllm_serve_plan.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port

from ridgefill.errors import RidgefillError
from ridgefill.backends.vllm import server as vserving
from ridgefill.serve import log as server_log, process
from ridgefill.serve.process import Launch, launch, running

# The stand-in for vLLM's server: answers /health, and /metrics with or without RidgeFill's counter; writes `preamble`,
# then (once the file `go` exists, at once without one) `burst` bytes of output in 100-byte lines, then creates
# `drained`; a line "tick N" every 50 ms while it waits; exits 0 on SIGTERM, and 3 after two minutes whatever happens
# (a test of a relay that stops reading ends instead of hanging).
CHILD = r"""
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

a = json.loads(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
threading.Timer(120, os._exit, (3,)).start()

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Authorization"):
            sys.stdout.write("authorization on %s\n" % self.path)
            sys.stdout.flush()
        body = {"/health": b"", "/metrics": a["metrics"].encode()}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", a["port"]), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
out = sys.stdout.buffer
out.write(a["preamble"].encode())
out.flush()
tick = 0
while a["go"] and not os.path.exists(a["go"]):
    out.write(b"tick %d\n" % tick)
    out.flush()
    tick += 1
    time.sleep(0.05)
for i in range(a["burst"] // 100):
    out.write(b"%-99d\n" % i)
out.flush()
open(a["drained"], "w").close()
time.sleep(600)
"""
STOCK_METRICS = "# HELP vllm:num_requests_running Number of requests.\nvllm:num_requests_running 0.0\n"
RIDGEFILL_METRICS = STOCK_METRICS + f"{vserving.MARKER} 0.0\n"
BURST = 2 << 20  # 2 MiB: far past a pipe's 64 KiB


def stand_in(tmp_path: Path, metrics: str = RIDGEFILL_METRICS, preamble: str = "", go: bool = False,
             log: Path | None = None, marker: str | None = None, log_limit: int = server_log.LOG_LIMIT,
             server=None) -> Launch:
    """A plan whose server is the stand-in child (CHILD), speaking as `server` (a Server: its title and log dialect)
    where given."""
    port = free_port()
    args = {"port": port, "metrics": metrics, "preamble": preamble, "burst": BURST,
            "go": str(tmp_path / "go") if go else "", "drained": str(tmp_path / "drained")}
    return Launch([sys.executable, "-c", CHILD, json.dumps(args)], dict(os.environ),
                  f"http://127.0.0.1:{port}/health", "up", log or tmp_path / "child.log", marker, log_limit,
                  **({"title": server.title, "dialect": server.log} if server is not None else {}))


def wait_for(path: Path, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return path.exists()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


# --- the server's output is read to its end ----------------------------------------------------------------------------
LAUNCHER = """
import json, sys
from pathlib import Path
from ridgefill.serve.process import Launch, launch
plan = json.loads(sys.argv[1])
sys.exit(launch(Launch(**{**plan, "log": Path(plan["log"])})))
"""


def test_a_closed_stderr_leaves_a_server_that_keeps_answering_and_its_log_drained(tmp_path):
    """`ridgefill serve ... 2>&1 | head -3`: the launching process's stderr is a pipe closed after three lines (the
    banner and two lines of the server's log). The server then writes 2 MiB: all of it reaches the log file (bounded
    at 256 KiB a file: the rest in <log>.1 and dropped), the server keeps answering, and SIGTERM ends both with the
    server's exit code."""
    plan = stand_in(tmp_path, go=True, log_limit=256 << 10)
    fields = {"argv": plan.argv, "env": plan.env, "health": plan.health, "banner": plan.banner, "log": str(plan.log),
              "log_limit": plan.log_limit}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(fields)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        lines = [proc.stderr.readline() for _ in range(3)]
        assert lines[0] == b"up\n" and all(line.startswith(b"tick ") for line in lines[1:]), lines
        proc.stderr.close()  # what `head -3` does after its third line
        (tmp_path / "go").touch()
        assert wait_for(tmp_path / "drained"), "the server blocked on its output: nobody read it"
        assert answers(plan.health) and proc.poll() is None
        last = plan.log.read_bytes().splitlines()[-1]
        assert int(last) == BURST // 100 - 1  # every line reached the log
        assert plan.log.stat().st_size <= 256 << 10 and Path(f"{plan.log}.1").stat().st_size <= 256 << 10
        proc.send_signal(signal.SIGTERM)  # forwarded to the server, which exits 0
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def launched(plan: Launch) -> subprocess.Popen:
    """`plan` run by launch() in a process of its own whose stderr is a pipe (the test reads it, or never does)."""
    fields = {"argv": plan.argv, "env": plan.env, "health": plan.health, "banner": plan.banner, "log": str(plan.log),
              "log_limit": plan.log_limit}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(fields)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def test_a_stderr_nobody_reads_never_holds_up_the_server(tmp_path):
    """`ridgefill serve ... 2>&1 | less` left unscrolled: stderr is a pipe that nobody reads. The server writes 2 MiB
    (32 pipes' worth) once up: it is read to its end (all of it in the log), the server keeps answering, and
    SIGTERM still ends both with the server's exit code."""
    plan = stand_in(tmp_path, go=True, log_limit=64 << 20)
    proc = launched(plan)
    try:
        assert proc.stderr.readline() == b"up\n"  # the banner: from here on the output is echoed
        (tmp_path / "go").touch()
        assert wait_for(tmp_path / "drained"), "the server blocked on its output: the echo held up the reading"
        assert answers(plan.health) and proc.poll() is None
        assert int(plan.log.read_bytes().splitlines()[-1]) == BURST // 100 - 1  # every line reached the log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_paused_stderr_gets_the_lines_it_can_and_the_count_of_those_dropped(tmp_path):
    """stderr paused (a terminal after Ctrl-S) while the server writes 2 MiB, then read again: the server was never
    held up; stderr shows, in order, the lines that fit the echo's buffer and then one line saying how many were
    dropped, and those shown plus those dropped are every line the server wrote since it was up (the log has all)."""
    plan = stand_in(tmp_path, go=True, log_limit=64 << 20)
    proc = launched(plan)
    try:
        assert proc.stderr.readline() == b"up\n"
        (tmp_path / "go").touch()
        assert wait_for(tmp_path / "drained"), "the server blocked on its output: the echo held up the reading"
        assert answers(plan.health)
        shown = []
        while not shown or not shown[-1].startswith(b"ridgefill serve: "):  # reading again: it catches up
            shown.append(proc.stderr.readline())
        proc.send_signal(signal.SIGTERM)
        shown += proc.stderr.read().splitlines(keepends=True)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    notices = [line for line in shown if line.startswith(b"ridgefill serve: ")]
    echoed = [line for line in shown if not line.startswith(b"ridgefill serve: ")]
    counts = [int(n.split()[2].replace(b",", b"")) for n in notices]
    assert notices and all(n == b"ridgefill serve: %s lines of the server's log were not shown here (stderr did not keep "
                                 b"up); %s has every line\n" % (f"{c:,}".encode(), str(plan.log).encode())
                           for n, c in zip(notices, counts))
    logged = plan.log.read_bytes().splitlines(keepends=True)
    since = logged[logged.index(echoed[0]):]  # every line written since the echo began: shown or dropped
    assert len(echoed) + sum(counts) == len(since) and sum(counts) > 0
    it = iter(since)
    assert all(line in it for line in echoed)  # the shown lines, in the server's order


def test_a_log_that_cannot_be_written_any_more_leaves_the_output_drained(tmp_path, capfd):
    """Every write to /dev/full fails (no space): the relay stops writing the log, says so once, and reads on."""
    plan = stand_in(tmp_path, log=Path("/dev/full"))
    with running(plan):
        assert wait_for(tmp_path / "drained"), "the server blocked on its output: nobody read it"
        assert answers(plan.health)
    err = capfd.readouterr().err
    assert err.count("warning: the server's log /dev/full cannot be written any more") == 1, err


def test_a_failing_stderr_ends_the_echo_only(tmp_path, monkeypatch):
    """In process: a stderr whose writes fail (a closed pipe) once the server is up: launch still reads the server's
    output to its end and returns its exit code."""

    class Closed:
        def isatty(self):
            return False

        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    plan = stand_in(tmp_path)
    monkeypatch.setattr(sys, "stderr", Closed())

    def stop_when_drained():
        wait_for(tmp_path / "drained")
        os.kill(os.getpid(), signal.SIGTERM)  # forwarded to the server

    thread = threading.Thread(target=stop_when_drained)
    thread.start()
    assert launch(plan) == 0
    thread.join()
    assert (tmp_path / "drained").exists() and int(plan.log.read_bytes().splitlines()[-1]) == BURST // 100 - 1


# --- the log file ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, match", [
    ("folder", r"\(Is a directory\)"),
    ("symlink", r"\(a symbolic link\)"),
    ("under-a-file", r"\(Not a directory\)"),
])
def test_a_log_that_cannot_be_opened_is_one_line_before_the_server_starts(case, match, tmp_path):
    target = tmp_path / "elsewhere.log"
    log = {"folder": tmp_path / "logs", "symlink": tmp_path / "link.log",
           "under-a-file": tmp_path / "file" / "vllm.log"}[case]
    if case == "folder":
        log.mkdir()
    elif case == "symlink":
        log.symlink_to(target)
    else:
        log.parent.write_text("a file")
    plan = stand_in(tmp_path, log=log)
    with pytest.raises(RidgefillError, match=rf"^cannot write the server's log to {log} {match}: give another --log-file$"):
        launch(plan)
    assert not (tmp_path / "drained").exists() and not target.exists()  # nothing started, nothing written


def test_log_file_as_a_folder_is_refused_by_the_command_before_anything(tmp_path, monkeypatch, capfd):
    """Through the console entry point: one line, exit 2, nothing written."""
    from ridgefill import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ridgefill", "serve", "--split", "3", "--log-file", str(tmp_path)])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2 and capfd.readouterr().err == (f"error: --log-file {tmp_path} is a folder: give a "
                                                                 f"file, e.g. {tmp_path}/serve.log\n")
    assert not any(tmp_path.iterdir())


def serve_exits_with(tmp_path, monkeypatch, capfd, *args: str) -> tuple[int, str]:
    """`ridgefill serve ARGS` through the console entry point: its exit code and stderr."""
    from ridgefill import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ridgefill", "serve", *args])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main()
    return exited.value.code, capfd.readouterr().err


def test_a_log_file_that_is_a_fifo_or_has_another_name_is_one_line(tmp_path, monkeypatch, capfd):
    """A FIFO would block serve's open() until something reads it; a file with a second hard link would be emptied
    and rewritten under both names. Each is refused in one line before anything starts; nothing written."""
    fifo, linked, other = tmp_path / "fifo.log", tmp_path / "linked.log", tmp_path / "other-name.log"
    os.mkfifo(fifo)
    linked.write_text("kept\n")
    os.link(linked, other)
    code, err = serve_exits_with(tmp_path, monkeypatch, capfd, "--split", "3", "--log-file", str(fifo))
    assert code == 2 and err == (f"error: --log-file {fifo} is not a regular file (a FIFO, a socket or a device; a "
                                 "FIFO would block serve until something reads it): give a file's path\n")
    code, err = serve_exits_with(tmp_path, monkeypatch, capfd, "--split", "3", "--log-file", str(linked))
    assert code == 2 and err == (f"error: --log-file {linked} has 2 hard links (serve empties and rewrites its log: "
                                 "the file under its other names would change too): give a path of its own\n")
    assert other.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "fifo.log", "linked.log", "other-name.log"]


@pytest.mark.parametrize("case", ["fifo", "hard link"])
def test_a_log_that_became_a_fifo_or_a_link_after_the_checks_is_refused_not_waited_on(case, tmp_path):
    """Put there after serve's checks, just before the server starts: open_log refuses it at once (a FIFO nobody reads
    is opened without blocking) and nothing starts."""
    log = tmp_path / "vllm.log"
    if case == "fifo":
        os.mkfifo(log)
    else:
        log.write_text("kept\n")
        os.link(log, tmp_path / "other-name.log")
    outcome = []

    def start():
        try:
            launch(stand_in(tmp_path, log=log))
        except RidgefillError as refused:
            outcome.append(str(refused))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(60)  # a hang guard: the old open() of a FIFO never returned
    why = "a FIFO" if case == "fifo" else "2 hard links"
    assert outcome == [f"cannot write the server's log to {log} ({why}): give another --log-file"]
    assert not (tmp_path / "drained").exists()
    if case == "hard link":
        assert (tmp_path / "other-name.log").read_text() == "kept\n"


def test_the_default_log_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    old = os.umask(0)  # the most permissive umask: the modes below are serve's own
    try:
        log = server_log.default_log(8123)
        server_log.LogFile(log).close()
    finally:
        os.umask(old)
    assert log == tmp_path / "state" / "ridgefill" / "serve-8123.log"
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700 and stat.S_IMODE(log.stat().st_mode) == 0o600
    log.parent.chmod(0o755)  # a folder of ours that others could enter: made private again
    assert stat.S_IMODE(server_log.default_log(8123).parent.stat().st_mode) == 0o700
    log.unlink()
    log.symlink_to(tmp_path / "planted")  # a symbolic link planted where the log goes: refused, nothing written
    with pytest.raises(RidgefillError, match=r"\(a symbolic link\): give another --log-file$"):
        server_log.LogFile(log)
    assert not (tmp_path / "planted").exists()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "linked"))
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "ridgefill").symlink_to(tmp_path / "state" / "ridgefill")
    with pytest.raises(RidgefillError, match=r"is a symbolic link or not a folder: give --log-file"):
        server_log.default_log(8123)


def test_the_log_is_bounded(tmp_path):
    """At `limit` bytes the log moves to <log>.1 (the one before dropped): at most two files of `limit` bytes,
    the newest lines in the log."""
    log = server_log.LogFile(tmp_path / "vllm.log", limit=10_000)
    lines = [b"%-99d\n" % i for i in range(1000)]  # 100 kB
    assert all(log.write(line) for line in lines)
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm.log", "vllm.log.1"]
    current, previous = (tmp_path / "vllm.log").read_bytes(), (tmp_path / "vllm.log.1").read_bytes()
    assert len(current) <= 10_000 and len(previous) == 10_000
    assert (previous + current).endswith(b"".join(lines[-100 - len(current) // 100:]))
    assert stat.S_IMODE((tmp_path / "vllm.log").stat().st_mode) == 0o600
    assert server_log.LOG_LIMIT == 32 << 20  # docs/serving.md gives the size


# --- is RidgeFill running? -----------------------------------------------------------------------------------------
def test_a_server_that_comes_up_without_the_plugin_is_stopped_with_one_line(tmp_path):
    """vLLM logs a plugin that failed to load and serves stock: its /metrics has no RidgeFill counter. launch stops
    it and says why in one line, with the reason vLLM logged."""
    preamble = ("ERROR 12-04 20:00:00 [__init__.py:1] Failed to load plugin ridgefill\nTraceback (most recent call "
                "last):\nImportError: cannot import name 'register' from 'ridgefill.backends.vllm.plugin.entry'\n")
    plan = stand_in(tmp_path, metrics=STOCK_METRICS, preamble=preamble, marker=vserving.MARKER, server=vserving.SERVER)
    with pytest.raises(RidgefillError) as refused:
        launch(plan)
    line = str(refused.value)
    assert line.startswith(f"vLLM's server came up without RidgeFill: its /metrics has no {vserving.MARKER}, so "
                           "RidgeFill did not load in it (ImportError: cannot import name 'register'")
    assert "reinstall ridgefill (pip install -e '.[vllm]', or make install)" in line
    assert line.endswith(f"see the server's log, {plan.log}") and "\n" not in line
    assert not answers(plan.health)  # stopped
    with pytest.raises(RidgefillError, match="came up without RidgeFill"), running(plan):
        pass


def test_a_server_with_the_plugin_passes_and_stock_plans_are_not_checked(tmp_path):
    with running(stand_in(tmp_path, marker=vserving.MARKER)) as child:
        assert child.poll() is None
    stock = stand_in(tmp_path, metrics=STOCK_METRICS)  # Server.launch without a fill: no marker looked for
    assert stock.marker is None
    with running(stock) as child:
        assert child.poll() is None


def test_the_start_up_checks_never_go_through_a_proxy_and_send_no_key(tmp_path, monkeypatch):
    """http_proxy (and https_proxy, all_proxy) point at a listener of the test's: serve's checks of /health and
    /metrics go straight to the server, so the listener receives nothing (an API key sent through it would travel in
    clear text), and the server gets no Authorization header (/health and /metrics are open)."""
    import socket

    received = []
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(8)
        proxy.settimeout(0.2)
        stop = threading.Event()

        def listen():
            while not stop.is_set():
                try:
                    conn, _ = proxy.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        received.append(conn.recv(65536))
                    except OSError:
                        received.append(b"(connected)")

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
            monkeypatch.setenv(name, url)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(process, "PLUGIN_WAIT_S", 5.0)  # the old code waited this long, then refused
        plan = stand_in(tmp_path, marker=vserving.MARKER)
        plan = Launch(plan.argv, {**plan.env, "VLLM_API_KEY": "s3cret"}, plan.health, plan.banner, plan.log,
                      plan.marker)
        try:
            with running(plan) as child:
                assert child.poll() is None
        finally:
            stop.set()
            thread.join()
    assert received == []
    assert b"authorization" not in plan.log.read_bytes()
