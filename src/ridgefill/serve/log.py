"""The server's log relay (`ridgefill serve`, both servers of `bench-serve`): the server's output read to its end
into a private, bounded log file (LogFile: 0600, a symbolic link or another user's file refused, rotated at
LOG_LIMIT) and echoed to stderr once it answers (Echo: a thread of its own that never holds up the reading). No
engine import.

The relay never stops reading the server's output: a log file that cannot be written any more, or a stderr that is
gone (`ridgefill serve ... 2>&1 | head -3`), ends that copy only; otherwise the server would block on a full pipe (64
KiB) and stop answering without exiting. A log file that cannot be opened is one line before the server starts.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from pathlib import Path

from ridgefill.backends.serving import LOG_LIMIT, UVICORN_UP  # a log file's bound, the line meaning up
from ridgefill.errors import RidgefillError

LINE_LIMIT = 1 << 16  # the longest piece of the server's output read at once (a longer line is copied in pieces)


def default_log(port: int) -> Path:
    """Where the server's log goes unless --log-file says: serve-<port>.log in this user's log folder (log_folder)."""
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
    """the server's log on disk. Opened before the server starts: created with mode 0600, a symbolic link or another user's
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
        return  # missing (created later), or unreadable: open_log says why, before the server starts
    if stat.S_ISDIR(info.st_mode):
        raise RidgefillError(f"--log-file {path} is a folder: give a file, e.g. {path}/serve.log")
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
        raise error(f"cannot write the server's log to {path} ({why}): give another --log-file") from None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_uid != os.geteuid():
        os.close(fd)
        raise error(f"cannot write the server's log to {path} (another user's file): give another --log-file")
    if stat.S_ISFIFO(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
        os.close(fd)
        why = "a FIFO" if stat.S_ISFIFO(info.st_mode) else f"{info.st_nlink} hard links"
        raise error(f"cannot write the server's log to {path} ({why}): give another --log-file")
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


ECHO_BUFFER = 1 << 20  # bytes of the server's output waiting for stderr at most: past it, echoed lines are dropped


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
    """the server's output echoed to stderr by a thread of its own, so that a stderr that does not keep up (a terminal
    paused with Ctrl-S, `serve 2>&1 | less` left unscrolled) never holds up the reading of the server's output: lines wait
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
                    self.write(f"ridgefill serve: {dropped:,} lines of the server's log were not shown here (stderr did not "
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

    def __init__(self, stream, log: LogFile, up: bytes = UVICORN_UP) -> None:
        super().__init__(daemon=True)
        self.stream, self.log, self.up = stream, log, up  # up: the line that says the server accepts requests
        self.started = False
        self.echo: Echo | None = None
        self._live = threading.Event()

    def go_live(self) -> None:
        self.echo = Echo(self.log.path)
        self.echo.start()
        self._live.set()

    def finish(self, timeout: float = 1.0) -> None:
        """After the child ended: let the echo write what waits (and the count of dropped lines), for at most
        `timeout` seconds (a stderr nobody reads never takes them)."""
        self.join()
        if self.echo is not None:
            self.echo.join(timeout)

    def run(self) -> None:
        try:
            for line in iter(lambda: self.stream.readline(LINE_LIMIT), b""):
                self.started = self.started or self.up in line
                if self.log.ok and not self.log.write(line):
                    say(f"warning: the server's log {self.log.path} cannot be written any more: its output goes on to "
                        "stderr only\n")
                if self._live.is_set() and self.echo is not None:
                    self.echo.put(line)
        finally:
            self.log.close()
            if self.echo is not None:
                self.echo.close()
