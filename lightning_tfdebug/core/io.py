"""The one writer for every file the pack writes: a debugging aid must never be what kills a run.

When the file system refuses a write (an :class:`OSError`), the writer warns once per ``tfdebug`` directory, records
the failure in :func:`write_failures` and returns ``False``; the caller keeps what it meant to write in memory and
training goes on. Any other error (an object that cannot be serialised) is a bug and raises. Whole-file writes are
atomic; appends write one complete line per call, so a killed process leaves at most one cut last line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from lightning_tfdebug.findings import Finding, TFDebugWarning


@dataclass(frozen=True)
class WriteFailure:
    """A write the file system refused: the path, and the error as ``"ErrorType: message"``."""

    path: str
    error: str


_lock = threading.Lock()
_failures: list[WriteFailure] = []
_warned_dirs: set[str] = set()


def write_failures() -> list[WriteFailure]:
    """Every write refused in this process so far, oldest first (a copy)."""
    with _lock:
        return list(_failures)


def _warning_scope(path: str) -> str:
    """The directory a refusal is warned about once: the nearest ``tfdebug`` directory above ``path`` (so one run's
    findings, reports, profiles and bundles give one warning), else ``path``'s own directory."""
    probe = os.path.abspath(path)
    while os.path.dirname(probe) != probe:  # up to the root
        if os.path.basename(probe) == "tfdebug":
            return probe
        probe = os.path.dirname(probe)
    return os.path.dirname(os.path.abspath(path))


def refused(path: str | os.PathLike[str], err: OSError, *, warn: bool = True) -> WriteFailure:
    """Record that the file system refused a write to ``path`` (also one this module did not make, such as a
    TensorBoard writer's flush) and warn once per ``tfdebug`` directory; ``warn=False`` only records it."""
    path = os.fspath(path)
    directory = _warning_scope(path)
    failure = WriteFailure(os.path.abspath(path), f"{type(err).__name__}: {err}")
    with _lock:
        _failures.append(failure)
        first = warn and directory not in _warned_dirs
        if warn:
            _warned_dirs.add(directory)
    if first:
        warnings.warn(
            f"lightning_tfdebug could not write {failure.path} ({failure.error}). Training goes on; findings stay "
            "in memory (`callback.findings`), in the warnings and in TensorBoard text. Further write failures under "
            f"{directory} are not warned about again. Free the disk or point the Trainer's log dir at a writable "
            "place to get the files.",
            category=TFDebugWarning,
            stacklevel=3,
        )
    return failure


def make_dirs(directory: str | os.PathLike[str]) -> bool:
    """Create ``directory`` and its parents; False (warned once) when the file system refuses."""
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        return True
    except OSError as err:
        refused(directory, err)
        return False


def process_umask() -> int:
    """The process's file-creation mask, read without changing it where Linux says it (``/proc/self/status``);
    elsewhere it is set and restored at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None], *, warn: bool = True) -> bool:
    """Have ``write(tmp)`` produce the file at a temporary path beside ``path``, then rename it into place.

    The file gets the mode an ordinary ``open(path, "w")`` would give it (teammates must be able to read it). Returns
    False (warned once; with ``warn=False`` only recorded) when the file system refuses; any other exception from
    ``write`` propagates, and the temporary file is removed.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(path))
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o666 & ~process_umask())
        with open(tmp, "rb+") as f:  # make the content durable before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as err:
        refused(path, err, warn=warn)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            with contextlib.suppress(OSError):
                os.remove(tmp)


def write_text(path: str | os.PathLike[str], text: str, *, warn: bool = True) -> bool:
    """Write ``text`` to ``path`` atomically; False (warned once, or only recorded with ``warn=False``) when the file
    system refuses."""

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return write_atomic(path, _write, warn=warn)


def append_line(path: str | os.PathLike[str], line: str, *, sync: bool = True) -> bool:
    """Append one line (a newline is added) to ``path`` in a single ``write`` and flush it; False (warned once) when
    refused. ``sync`` also calls ``fsync`` (findings: rare and precious)."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            if sync:
                os.fsync(f.fileno())
        return True
    except OSError as err:
        refused(path, err)
        return False


def publish_dir(build: Callable[[str], None], root: str | os.PathLike[str], name: str) -> str | None:
    """Build a directory with ``build(tmp_dir)`` and rename it to ``root/name`` (``name-1``, ``name-2``... if taken):
    complete or absent, never over an earlier one. Returns its path, or None (warned once) when the file system
    refuses; any other exception from ``build`` propagates."""
    root = os.fspath(root)
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-")
        os.chmod(tmp, 0o777 & ~process_umask())  # mkdtemp makes it 0o700; a bundle is for the team too
        build(tmp)
        suffix = 0
        while True:
            final = os.path.join(root, name + (f"-{suffix}" if suffix else ""))
            if not os.path.exists(final):
                try:
                    os.rename(tmp, final)  # atomic; fails if another writer took the name meanwhile
                    tmp = None
                    return final
                except OSError:
                    if not os.path.exists(final):
                        raise
            suffix += 1
    except OSError as err:
        refused(os.path.join(root, name), err)
        return None
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def append_finding(path: str | os.PathLike[str], finding: Finding) -> bool:
    """Append one finding as a JSON line and sync it; False (warned once) when the file system refused."""
    return append_line(path, finding.to_json())
