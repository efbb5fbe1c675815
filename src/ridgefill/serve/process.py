"""The server as a child process (`ridgefill serve`, both servers of `bench-serve`): started in its own process group
from a `Launch` plan, its output relayed into a private, bounded log file (and to stderr once it answers: serve/log.py),
watched until it answers, checked to run RidgeFill (its marker on /metrics), signals forwarded, stopped. Why it failed
is read from its log in the engine's dialect (Launch.dialect: backends/serving.LogDialect). No engine import.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from ridgefill.backends.serving import Launch, LogDialect
from ridgefill.errors import RidgefillError
from ridgefill.serve.log import LogFile, Relay, say


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PLUGIN_WAIT_S = 30.0  # how long an answering server may take to show RidgeFill's counters on /metrics
STOP_GRACE_S = 60.0  # SIGTERM, then SIGKILL after this long


# --- running the server -----------------------------------------------------------------------------------------
def launch(plan: Launch) -> int:
    """Run the server as a child process in its own process group until it ends, forwarding SIGINT, SIGTERM and
    SIGHUP to it (each reaches it once, also a Ctrl-C at a terminal); the child gets SIGTERM if this process dies.
    Its output goes to plan.log, and to stderr too once it is up. If it ends before it is up (and no signal was
    forwarded), or comes up without RidgeFill (check_plugin), a RidgefillError says why. Returns its exit code
    (128 + N when signal N ended it)."""
    child, relay = start(plan)
    signalled = []

    def forward(signum, frame):
        signalled.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        up = wait_until_up(child, plan.health, relay)
        if up and check_plugin(plan, child):
            say(plan.banner + "\n")
            relay.go_live()
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:  # only if waiting failed, or the server runs without RidgeFill
            stop(child)
        relay.finish()
    code = code if code >= 0 else 128 - code
    if not up and not signalled:
        raise RidgefillError(start_failure(plan, code))
    return code


def start(plan: Launch) -> tuple[subprocess.Popen, Relay]:
    """The server's process (its own process group; SIGTERM if this process dies) and the relay of its output into
    plan.log (opened first: a log that cannot be written is a RidgefillError before anything starts)."""
    log = LogFile(plan.log, plan.log_limit)
    try:
        child = subprocess.Popen(plan.argv, env=plan.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 preexec_fn=_own_group(os.getpid()))
    except BaseException:
        log.close()
        raise
    relay = Relay(child.stdout, log, plan.dialect.up)
    relay.start()
    return child, relay


@contextmanager
def running(plan: Launch):
    """The server of `plan`, up and checked (check_plugin), for the block (its log in plan.log only), then stopped.
    A server that ends before it is up is a RidgefillError saying why."""
    child, relay = start(plan)
    try:
        if not (wait_until_up(child, plan.health, relay) and check_plugin(plan, child)):
            code = child.wait()
            relay.join()
            raise RidgefillError(start_failure(plan, code))
        yield child
    finally:
        if child.poll() is None:
            stop(child)
        relay.join()


def stop(child: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S; waits for it."""
    _signal_group(child, signal.SIGTERM)
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(child, signal.SIGKILL)
        child.wait()


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass


def wait_until_up(child: subprocess.Popen, health: str, relay: Relay) -> bool:
    """Wait until the server answers `health` (or logs that it started) or the child ends; True if it is up."""
    from ridgefill.runtime.console import console

    out = console(stderr=True)
    status = out.status("starting the server (loading the model)…") if out.is_terminal else None
    if status is not None:
        status.start()
    try:
        while child.poll() is None:
            if relay.started or _fetch(health) is not None:
                return True
            time.sleep(0.5)
        return False
    finally:
        if status is not None:
            status.stop()


def _fetch(url: str) -> str | None:
    """The body of `url` if it answers 200, else None. Straight to the server, never through a proxy (http_proxy,
    https_proxy and all_proxy are ignored: the server is on this machine), and with no credentials: /health and
    /metrics are open in every server, with or without an API key."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url), timeout=5) as r:
            return r.read().decode(errors="replace") if r.status == 200 else None
    except (OSError, ValueError):
        return None


# --- is RidgeFill running in it? ---------------------------------------------------------------------------------
def check_plugin(plan: Launch, child: subprocess.Popen) -> bool:
    """For a plan with a marker: wait until the server's /metrics answers and holds a line starting with it (only
    RidgeFill, loaded in the engine, creates that counter). False if the child ended meanwhile; a RidgefillError if
    it answers without the marker (a server may log that RidgeFill failed to load and serve stock)."""
    if plan.marker is None:
        return True
    url = plan.health.removesuffix("/health") + "/metrics"
    deadline = time.monotonic() + PLUGIN_WAIT_S
    while child.poll() is None:
        body = _fetch(url)
        if body is not None and any(line.startswith(plan.marker) for line in body.splitlines()):
            return True
        if body is not None or time.monotonic() > deadline:
            raise RidgefillError(plugin_error(plan))
        time.sleep(0.5)
    return False


def plugin_error(plan: Launch) -> str:
    """One line for a server that came up without RidgeFill: the reason its log gives (after the dialect's
    fill_failed line), if any, and the engine's fix."""
    log, dialect = read_log(plan.log), plan.dialect
    failed = log.find(dialect.fill_failed) if dialect.fill_failed else -1
    errors = root_errors(log[failed:], dialect) if failed >= 0 else []
    reason = f" ({errors[0][0].rsplit('.', 1)[-1]}: {_short(errors[0][1])})" if errors else ""
    return (f"{plan.title}'s server came up without RidgeFill: its /metrics has no {plan.marker}, so RidgeFill did "
            f"not load in it{reason} and every ridgefill_* option would be ignored; it was stopped: "
            f"{dialect.fill_fix}, and see the server's log, {plan.log}")


# --- why it did not start -----------------------------------------------------------------------------------------
def read_log(path: Path) -> str:
    """The log file's text ("" if it is no regular file or cannot be read)."""
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def root_errors(log: str, dialect: LogDialect = LogDialect()) -> list[tuple[str, str]]:
    """The (error type, message) of every line of a server's log that names an error, in the dialect's forms (a
    form without a type gives "error"), but the dialect's generic failures."""
    errors = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = next((m for pattern in dialect.errors if (m := pattern.match(line.strip()))), None)
        if m is None:
            continue
        kind, message = (m.group(1), m.group(2).strip()) if m.re.groups > 1 else ("error", m.group(1).strip())
        if any(g in message for g in dialect.generic):
            continue
        if re.match(r"\d+ validation errors? for ", message) and i + 1 < len(lines):  # pydantic: the reason follows
            message = lines[i + 1].strip().removeprefix("Value error, ").split(" [type=")[0]
        errors.append((kind, message))
    return errors


def start_failure(plan: Launch, code: int) -> str:
    """startup_error for the server of `plan`, which ended with `code` before it was up: its log read in its dialect,
    the port it was to listen on (its health URL's) named in a fix."""
    from urllib.parse import urlparse

    return startup_error(read_log(plan.log), code, plan.log, plan.dialect, urlparse(plan.health).port)


def startup_error(log: str, code: int, path: Path, dialect: LogDialect = LogDialect(), port: int | None = None) -> str:
    """One line for a server that ended before it was up: the root error in its log (RidgeFill's own refusal as it
    is), the fix where the engine's dialect knows it (`port` named in it), and where the whole log is."""
    errors = root_errors(log, dialect)
    ours = [message for kind, message in errors if kind.endswith("RidgefillError")]
    if ours:
        return f"{ours[0]} (the server's log: {path})"
    if not errors:
        return f"the server exited with code {code} before it answered: see its log, {path}"
    kind, message = next(((k, m) for k, m in errors if any(p.search(m) for p, _ in dialect.fixes)), errors[0])
    fix = next((f for pattern, f in dialect.fixes if pattern.search(message)), "see the log")
    fix = fix.format(port=port if port is not None else "?")
    what = f"{kind.rsplit('.', 1)[-1]}: " if kind != "error" else ""
    return f"the server could not start ({what}{_short(message)}): {fix} (the server's log: {path})"


def _short(message: str) -> str:
    return message if len(message) <= 300 else message[:297] + "..."


def _own_group(parent: int):
    def setup() -> None:  # in the child, before exec
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before that took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup
