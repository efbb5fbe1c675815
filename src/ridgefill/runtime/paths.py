"""Where ridgefill keeps converted models and downloaded corpora, how it writes files atomically, and the one check
of a command's output path before any work."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ridgefill.errors import RidgefillError

# A temporary that `atomic_path` cannot tie to a writer on this machine (one of another machine sharing the folder,
# or one written before temporaries named their writer) is stale once nothing in it changed for this long.
STALE_AFTER_S = 24 * 3600
_NAME_MAX = 255  # the longest file name most file systems take
_RANDOM = r"[a-z0-9_]{8}"  # the random part tempfile.mkdtemp adds


def cache_dir() -> Path:
    """$RIDGEFILL_CACHE, else ~/.cache/ridgefill."""
    return Path(os.environ.get("RIDGEFILL_CACHE", Path.home() / ".cache" / "ridgefill"))


# --- atomic writes --------------------------------------------------------------------------------------------
@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; rename it over `path` only if the block succeeds, after its bytes are
    on disk (fsync; the folder too after the rename, where the file system allows): a file that exists is whole.
    Works for files and folders: a reader never sees a half-written result.

    The temporary lives in a folder `.<name>.<pid>@<host>.<random>/` beside `path`; a write of `path` first removes
    those a killed writer left (remove_stale_temporaries), never a running writer's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(path.name), dir=path.parent)) / path.name
    try:
        yield tmp
        _sync(tmp)
        if path.is_dir() and tmp.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
        _sync_folder(path.parent)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def publish_folder_once(folder: str | Path, build: Callable[[Path], None]) -> bool:
    """Make `folder` with `build(tmp)` unless it exists; return whether this call made it. The folder is built in a
    private temporary beside it, synced, and renamed into place only while nothing is there: a folder that exists is
    whole, and is never replaced or removed (another process may be reading it). Callers on this machine take turns
    (a lock file beside it), so the second finds the first's folder and builds nothing; one whose folder appeared
    meanwhile all the same (another machine sharing the folder) discards its own copy and keeps the one there."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if folder.exists():
            return False
        remove_stale_temporaries(folder)
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(folder.name), dir=folder.parent)) / folder.name
        try:
            build(tmp)
            _sync(tmp)
            return _rename_if_absent(tmp, folder)
        finally:
            shutil.rmtree(tmp.parent, ignore_errors=True)


def _rename_if_absent(tmp: Path, folder: Path) -> bool:
    """Rename the folder `tmp` to `folder` unless a folder with files is there (then leave both as they are)."""
    try:
        os.rename(tmp, folder)  # refused onto a folder that holds anything, never replacing it
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR) and folder.exists():
            return False
        raise
    _sync_folder(folder.parent)
    return True


def write_json(path: str | Path, data) -> None:
    """Strict JSON (NaN and infinities become null), written atomically and synced to disk."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_finite(data), indent=2, default=_json_default, allow_nan=False) + "\n")


def _sync(tmp: Path) -> None:
    """fsync a written file, or every file of a written folder (and the folders, where the file system allows)."""
    if tmp.is_symlink() or not tmp.exists():
        return
    if tmp.is_dir():
        for inner in sorted(tmp.rglob("*")):
            if inner.is_file() and not inner.is_symlink():
                _sync_file(inner)
        for folder in [tmp, *(p for p in tmp.rglob("*") if p.is_dir() and not p.is_symlink())]:
            _sync_folder(folder)
        return
    _sync_file(tmp)


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    """fsync a folder's entries (a rename in it), best effort: not every platform or file system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _writer() -> str:
    """This process as a temporary's name tells it: `<pid>@<host>` (the host in letters, digits and dashes)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:24]
    return f"{os.getpid()}@{host}"


def _temporary_prefix(name: str) -> str:
    """`.<name>.<pid>@<host>.`, or `.<name>.` where that would make the folder's name too long."""
    prefix = f".{name}.{_writer()}."
    return prefix if len(prefix) + 8 <= _NAME_MAX else f".{name}."


def remove_stale_temporaries(path: str | Path, now: float | None = None) -> list[Path]:
    """Remove the temporary folders that earlier writes of `path` left beside it when their writer was killed:
    those of a process of this machine that is no longer running, and those of no known writer (another machine's,
    or unnamed ones from before temporaries named their writer) unchanged for STALE_AFTER_S. Only folders named as
    atomic_path names them that hold nothing but `path`'s own name are touched. Returns what was removed."""
    path = Path(path)
    prefix = f".{path.name}."
    pattern = re.compile(rf"(?:(\d+)@([A-Za-z0-9-]*)\.)?{_RANDOM}")
    try:
        entries = [e for e in os.scandir(path.parent) if e.name.startswith(prefix)]
    except OSError:
        return []
    here = _writer().split("@", 1)[1]
    now = time.time() if now is None else now
    removed = []
    for entry in entries:
        found = pattern.fullmatch(entry.name[len(prefix):])
        if found is None or not entry.is_dir(follow_symlinks=False):
            continue
        folder = Path(entry.path)
        try:
            inside = list(folder.iterdir())
            if any(p.name != path.name for p in inside):  # not a temporary of this output
                continue
            pid, host = found.group(1), found.group(2)
            if pid is not None and host == here:
                stale = not _running(int(pid))
            else:
                stale = now - max(p.lstat().st_mtime for p in [folder, *inside]) > STALE_AFTER_S
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    """Whether a process with this id runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    except OSError:
        return True
    return True


# --- outputs ----------------------------------------------------------------------------------------------------
WRITTEN_ROLES = ("output", "store")  # options a command writes (commands.option's role), not inputs


def check_output(config, field: str = "out", beside: tuple[str, ...] = ()) -> None:
    """Refuse, before any work, the output option `field` of a command's `config` when writing it must fail or would
    destroy an input: it is an existing folder; its folder is a file or cannot be written; it is the same file as
    another option's value, or lies inside a folder another option names (the command's inputs: every other option
    that names an existing file or folder, e.g. --model's checkpoint folder or --data's corpus folder; not the
    folders the command writes: an option whose role is output or store, or one named out_dir; and the folders
    config.input_folders() names, e.g. the cache folder of --model's alias, resolved). `beside`: the
    suffixes of files the command writes next to it (".json": `<out>.json`), checked the same way. A file that only
    the command itself reads and writes (calibrate's `<out>.partial` on --resume) names no option: it is allowed.
    Nothing to check when the option is None (its default goes elsewhere)."""
    out = getattr(config, field)
    if out is None:
        return
    flag = "--" + field.replace("_", "-")
    out = Path(out)
    inputs = _inputs(config, field)
    resolved = config.input_folders() if hasattr(config, "input_folders") else {}
    inputs.update(resolved)
    for target in [out, *(Path(f"{out}{suffix}") for suffix in beside)]:
        what = f"{flag} {out}" if target == out else f"{flag} {out}: {target} (written beside it)"
        _check_writable(target, what, flag, target == out)
        for name, value in inputs.items():
            option = "--" + name.replace("_", "-")
            if _same_file(target, value):
                raise RidgefillError(f"{what} is the file {option} reads: writing it would replace that input: choose "
                                     f"another {flag}")
            if _inside(target, value, name in resolved):
                raise RidgefillError(f"{what} is inside the folder {option} reads ({value}): writing there would "
                                     f"change that input: choose another {flag}, outside it")


def _check_writable(target: Path, what: str, flag: str, is_out: bool) -> None:
    """Refuse a target that is an existing folder, or whose folder is a file or cannot be written."""
    if target.is_dir():
        fix = "name a file to write, not a folder" if is_out else f"move that folder away or choose another {flag}"
        raise RidgefillError(f"{what} is an existing folder: {fix}")
    folder = target.parent
    nearest = folder
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if nearest.exists() and not nearest.is_dir():
        raise RidgefillError(f"{what} cannot be written: {nearest} is a file, not a folder: choose another {flag}")
    if nearest == folder and folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise RidgefillError(f"{what} cannot be written: the folder {folder} is not writable: choose a folder you "
                             "can write to, or change its permissions")


def _inputs(config, field: str) -> dict[str, str | Path]:
    """The options of `config` other than `field` that may name an input (a path): all but those it writes."""
    roles = {f.name: f.metadata.get("ridgefill", {}).get("role") for f in dataclasses.fields(config)} \
        if dataclasses.is_dataclass(config) else {}
    return {name: value for name, value in vars(config).items()
            if name != field and name != "out_dir" and roles.get(name) not in WRITTEN_ROLES
            and isinstance(value, (str, Path)) and value != ""}


def _same_file(path: Path, other: str | Path) -> bool:
    try:
        return path.exists() and os.path.exists(other) and os.path.samefile(path, other)
    except (OSError, ValueError):
        return False


def _inside(path: Path, folder: str | Path, folder_to_be: bool = False) -> bool:
    """Whether `path` (existing or not) is `folder`, an existing folder (or one still to be made: `folder_to_be`), or
    lies inside it (links resolved)."""
    try:
        if not (folder_to_be or os.path.isdir(folder)):
            return False
        return path.resolve().is_relative_to(Path(folder).resolve())
    except (OSError, ValueError, RuntimeError):
        return False


# --- JSON -------------------------------------------------------------------------------------------------------
def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _finite(obj.tolist())
    return obj


def _json_default(obj):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (64 hex digits)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_sha256(value) -> bool:
    """Whether `value` is a whole sha256 in hex (64 digits): a pin that names one file's bytes, not a prefix that
    many match (an empty or one-digit "pin" matches any file)."""
    return isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{64}", value) is not None


def file_hash(path: str | Path) -> str:
    """A file's short hash: the first 16 hex digits of its sha256."""
    return file_sha256(path)[:16]


def read_text(path, what: str) -> str:
    """The UTF-8 text of a file a command reads (`what`: the option that names it, e.g. --prompt-file); a file
    that cannot be read or is not UTF-8 text (binary, another encoding) is a one-line error."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")  # a leading byte-order mark is not part of the text
    except UnicodeDecodeError as exc:
        raise RidgefillError(f"{what} {path} is not UTF-8 text (byte {exc.start} cannot be decoded): pass a text "
                             "file, converted to UTF-8") from None
    except OSError as exc:
        raise RidgefillError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
