"""vLLM's server as a child process (`ridgefill serve`, both servers of `bench-serve`): started in its own process
group from a `Launch` plan, its output relayed into a private, bounded log file (and to stderr once it answers),
watched until it answers, checked to run RidgeFill's plugin, signals forwarded, stopped. No vLLM import.

The relay never stops reading vLLM's output: a log file that cannot be written any more, or a stderr that is gone
(`ridgefill serve ... 2>&1 | head -3`), ends that copy only; otherwise vLLM would block on a full pipe (64 KiB) and
the server stop answering without exiting. A log file that cannot be opened is one line before vLLM starts.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ridgefill.errors import RidgefillError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOG_LIMIT = 32 << 20  # bytes of vLLM's log in one file: past it the file moves to <log>.1 (the previous one dropped)
LINE_LIMIT = 1 << 16  # the longest piece of vLLM's output read at once (a longer line is copied in pieces)
PLUGIN_WAIT_S = 30.0  # how long an answering server may take to show RidgeFill's counters on /metrics
STOP_GRACE_S = 60.0  # SIGTERM, then SIGKILL after this long


@dataclass(frozen=True)
class Launch:
    """One server start: its command, environment, where it answers when up, what to say then, and its log."""

    argv: list[str]
    env: dict[str, str]
    health: str  # URL that answers 200 once the server is up
    banner: str  # printed (one line) once it is up
    log: Path
    marker: str | None = None  # a /metrics line starts with it only when RidgeFill runs (None: not checked)
    log_limit: int = LOG_LIMIT


def default_log(port: int) -> Path:
    """Where vLLM's log goes unless --log-file says: serve-<port>.log in this user's log folder (log_folder)."""
    return log_folder() / f"serve-{port}.log"


def log_folder() -> Path:
    """This user's folder for the servers' logs ($XDG_STATE_HOME/ridgefill, else ~/.local/state/ridgefill), made if
    missing, which only this user can enter."""
    state = os.environ.get("XDG_STATE_HOME", "").strip() or Path.home() / ".local" / "state"
    return private_folder(Path(state) / "ridgefill")


def private_folder(folder: Path) -> Path:
    """`folder`, made if missing, only its owner's (mode 0700): refused if it is a symbolic link, not a folder, or
    another user's."""
    fix = "give --log-file, or remove it"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = os.lstat(folder)
    except OSError as exc:
        raise RidgefillError(f"cannot make the log folder {folder} ({exc.strerror or exc}): {fix}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RidgefillError(f"the log folder {folder} is a symbolic link or not a folder: {fix}")
    if info.st_uid != os.geteuid():
        raise RidgefillError(f"the log folder {folder} belongs to another user: {fix}")
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


class LogFile:
    """vLLM's log on disk. Opened before vLLM starts: created with mode 0600, a symbolic link or another user's
    file refused, emptied. Bounded: past `limit` bytes a regular file moves to <log>.1 and a new one begins. A write
    that fails (a full disk, the file system gone) ends the writing, never the caller: `ok` turns False."""

    def __init__(self, path: Path, limit: int = LOG_LIMIT) -> None:
        self.path, self.limit, self.size, self.ok = path, limit, 0, True
        self.fd = open_log(path)
        self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)

    def write(self, data: bytes) -> bool:
        """Append `data`; False if the log cannot be written (then, and after, nothing is written)."""
        if not self.ok:
            return False
        try:
            if self.regular and self.size and self.size + len(data) > self.limit:
                self._rotate()
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            self.size += len(data)
        except OSError:
            self.ok = False
            self.close()
        return self.ok

    def _rotate(self) -> None:
        os.replace(self.path, f"{self.path}.1")
        os.close(self.fd)
        self.fd, self.size = -1, 0
        self.fd = open_log(self.path, OSError)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def check_log_file(path: Path) -> None:
    """A --log-file the user gave: a new path, or a regular file with one name. A folder, a FIFO (opening it would
    block until something reads it), a socket or a device is refused, and so is a file with more than one hard link
    (serve empties and rewrites its log: the file under its other names would change too)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # missing (created later), or unreadable: open_log says why, before vLLM starts
    if stat.S_ISDIR(info.st_mode):
        raise RidgefillError(f"--log-file {path} is a folder: give a file, e.g. {path}/vllm.log")
    if not stat.S_ISREG(info.st_mode):
        raise RidgefillError(f"--log-file {path} is not a regular file (a FIFO, a socket or a device; a FIFO would "
                             "block serve until something reads it): give a file's path")
    if info.st_nlink > 1:
        raise RidgefillError(f"--log-file {path} has {info.st_nlink} hard links (serve empties and rewrites its log: "
                             "the file under its other names would change too): give a path of its own")


def open_log(path: Path, error: type[Exception] = RidgefillError) -> int:
    """A file descriptor writing `path` from its start, created 0600; `error` (one line naming the fix) for a path
    that cannot be written, a folder, a symbolic link or another user's file."""
    try:
        if not os.path.lexists(path.parent):
            path.parent.mkdir(parents=True)
        # O_NONBLOCK: a FIFO put there since serve's checks fails at once (ENXIO) instead of blocking until read
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        os.set_blocking(fd, True)
    except OSError as exc:
        why = ("a symbolic link" if os.path.islink(path) else "a FIFO" if exc.errno == errno.ENXIO
               else exc.strerror or str(exc))
        raise error(f"cannot write vLLM's log to {path} ({why}): give another --log-file") from None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_uid != os.geteuid():
        os.close(fd)
        raise error(f"cannot write vLLM's log to {path} (another user's file): give another --log-file")
    if stat.S_ISFIFO(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
        os.close(fd)
        why = "a FIFO" if stat.S_ISFIFO(info.st_mode) else f"{info.st_nlink} hard links"
        raise error(f"cannot write vLLM's log to {path} ({why}): give another --log-file")
    if stat.S_ISREG(info.st_mode):
        os.ftruncate(fd, 0)
        os.fchmod(fd, 0o600)
    return fd


def say(text: str) -> bool:
    """`text` on stderr; False if stderr is gone (a closed pipe, `serve 2>&1 | head -3`): nothing else stops."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        return True
    except (OSError, ValueError, AttributeError):
        return False


ECHO_BUFFER = 1 << 20  # bytes of vLLM's output waiting for stderr at most: past it, echoed lines are dropped


def _stderr_writer():
    """Bytes to stderr: straight to its file descriptor where it has one (a blocked write there holds no lock of
    Python's, so the process can still exit), else through sys.stderr."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None

    def write(data: bytes) -> None:
        if fd is None:
            sys.stderr.write(data.decode(errors="replace"))
            sys.stderr.flush()
            return
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    return write


class Echo(threading.Thread):
    """vLLM's output echoed to stderr by a thread of its own, so that a stderr that does not keep up (a terminal
    paused with Ctrl-S, `serve 2>&1 | less` left unscrolled) never holds up the reading of vLLM's output: lines wait
    in a buffer of at most `limit` bytes, and past it they are dropped (the log file has every line). When it has
    caught up, and at the end, one line says how many were dropped. A stderr that fails (a closed pipe) ends it."""

    def __init__(self, log: Path, write=None, limit: int = ECHO_BUFFER) -> None:
        super().__init__(daemon=True)
        self.log, self.write, self.limit = log, write or _stderr_writer(), limit
        self.lines, self.waiting, self.dropped, self.closed, self.ok = [], 0, 0, False, True
        self.cond = threading.Condition()

    def put(self, line: bytes) -> None:
        """Queue `line` for stderr (never blocks): dropped when `limit` bytes wait already."""
        with self.cond:
            if not self.ok:
                return
            if self.waiting + len(line) > self.limit:
                self.dropped += 1
                return
            self.lines.append(line)
            self.waiting += len(line)
            self.cond.notify()

    def close(self) -> None:
        """No more lines: write those waiting (and the count of dropped ones), then end."""
        with self.cond:
            self.closed = True
            self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.lines and not self.dropped and not self.closed:
                    self.cond.wait()
                batch, self.lines, self.waiting = self.lines, [], 0
                dropped = self.dropped if not batch else 0  # said once what was queued before is written
                self.dropped -= dropped
                closed = self.closed and not batch and not self.dropped
            try:
                if batch:
                    self.write(b"".join(batch))
                if dropped:
                    self.write(f"ridgefill serve: {dropped:,} lines of vLLM's log were not shown here (stderr did not "
                               f"keep up); {self.log} has every line\n".encode())
            except (OSError, ValueError, AttributeError):
                with self.cond:
                    self.ok, self.lines, self.waiting = False, [], 0
                return
            if closed:
                return


class Relay(threading.Thread):
    """Reads the child's output until it ends, whatever happens to where it goes: into the log file, and to stderr
    (through Echo, which never blocks the reading) once `go_live` is called. A failing copy ends that copy only."""

    STARTED = b"Application startup complete"  # uvicorn's line once the server accepts requests

    def __init__(self, stream, log: LogFile) -> None:
        super().__init__(daemon=True)
        self.stream, self.log = stream, log
        self.started = False
        self.echo: Echo | None = None
        self._live = threading.Event()

    def go_live(self) -> None:
        self.echo = Echo(self.log.path)
        self.echo.start()
        self._live.set()

    def finish(self, timeout: float = 5.0) -> None:
        """After the child ended: let the echo write what waits (and the count of dropped lines), for at most
        `timeout` seconds (a stderr nobody reads never takes them)."""
        self.join()
        if self.echo is not None:
            self.echo.join(timeout)

    def run(self) -> None:
        try:
            for line in iter(lambda: self.stream.readline(LINE_LIMIT), b""):
                self.started = self.started or self.STARTED in line
                if self.log.ok and not self.log.write(line):
                    say(f"warning: vLLM's log {self.log.path} cannot be written any more: its output goes on to "
                        "stderr only\n")
                if self._live.is_set() and self.echo is not None:
                    self.echo.put(line)
        finally:
            self.log.close()
            if self.echo is not None:
                self.echo.close()


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
        raise RidgefillError(startup_error(read_log(plan.log), code, plan.log))
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
    relay = Relay(child.stdout, log)
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
            raise RidgefillError(startup_error(read_log(plan.log), code, plan.log))
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
    status = out.status("starting vLLM (loading the model)…") if out.is_terminal else None
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
    /metrics are open in vLLM's server, with or without --api-key."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url), timeout=5) as r:
            return r.read().decode(errors="replace") if r.status == 200 else None
    except (OSError, ValueError):
        return None


# --- is RidgeFill running in it? ---------------------------------------------------------------------------------
def check_plugin(plan: Launch, child: subprocess.Popen) -> bool:
    """For a plan with a marker: wait until the server's /metrics answers and holds a line starting with it (only
    RidgeFill's plugin, loaded in the engine, creates that counter). False if the child ended meanwhile; a
    RidgefillError if it answers without the marker (vLLM logs a plugin that failed to load and serves stock)."""
    if plan.marker is None:
        return True
    url = plan.health.removesuffix("/health") + "/metrics"
    deadline = time.monotonic() + PLUGIN_WAIT_S
    while child.poll() is None:
        body = _fetch(url)
        if body is not None and any(line.startswith(plan.marker) for line in body.splitlines()):
            return True
        if body is not None or time.monotonic() > deadline:
            raise RidgefillError(plugin_error(read_log(plan.log), plan.marker, plan.log))
        time.sleep(0.5)
    return False


def plugin_error(log: str, marker: str, path: Path) -> str:
    """One line for a server that came up without RidgeFill: the reason vLLM logged for the plugin, if any."""
    failed = log.find("Failed to load plugin")
    errors = root_errors(log[failed:]) if failed >= 0 else []
    reason = f" ({errors[0][0].rsplit('.', 1)[-1]}: {_short(errors[0][1])})" if errors else ""
    return (f"vLLM's server came up without RidgeFill: its /metrics has no {marker}, so the plugin did not load in "
            f"vLLM's processes{reason} and every ridgefill_* option would be ignored; it was stopped: reinstall "
            f"ridgefill (pip install -e '.[vllm]', or make install) and see vLLM's log, {path}")


# --- why it did not start -----------------------------------------------------------------------------------------
ERROR_LINE = re.compile(r"^(?:\([^)]*\)\s*)?(?:\S+\s+){0,6}?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")
GENERIC = ("Engine core initialization failed", "Engine process failed to start", "EngineCore failed to start")
FIXES = (  # (a pattern of the reason, the fix named with it)
    (re.compile(r"memory|KV cache|kv cache", re.I), "lower --max-model-len or --kv-cache-gib, or free memory"),
    (re.compile(r"address already in use", re.I), "pick another --port"),
    (re.compile(r"max_model_len|max-model-len|maximum model length", re.I), "lower --max-model-len"),
)


def read_log(path: Path) -> str:
    """The log file's text ("" if it is no regular file or cannot be read)."""
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def root_errors(log: str) -> list[tuple[str, str]]:
    """The (exception type, message) of every error line in a vLLM log, but vLLM's generic start-up failures."""
    errors = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = ERROR_LINE.match(line.strip())
        if m and not any(g in m.group(2) for g in GENERIC):
            message = m.group(2).strip()
            if re.match(r"\d+ validation errors? for ", message) and i + 1 < len(lines):  # pydantic: the reason follows
                message = lines[i + 1].strip().removeprefix("Value error, ").split(" [type=")[0]
            errors.append((m.group(1), message))
    return errors


def startup_error(log: str, code: int, path: Path) -> str:
    """One line for a server that ended before it was up: the root error in its log (RidgeFill's own refusal as it
    is), the fix where it is known, and where the whole log is."""
    errors = root_errors(log)
    ours = [message for kind, message in errors if kind.endswith("RidgefillError")]
    if ours:
        return f"{ours[0]} (vLLM's log: {path})"
    if not errors:
        return f"vLLM's server exited with code {code} before it answered: see its log, {path}"
    kind, message = errors[0]
    fix = next((f for pattern, f in FIXES if pattern.search(message)), "see the log")
    return f"vLLM could not start ({kind.rsplit('.', 1)[-1]}: {_short(message)}): {fix} (vLLM's log: {path})"


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
