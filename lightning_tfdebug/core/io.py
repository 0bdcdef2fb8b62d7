"""The one writer for every file the pack writes: findings, NaN reports, profiles, bundles, per-rank files, reports.

A debugging aid must never be what kills a run. Every write goes through this module; when the file system refuses
(a file where the ``tfdebug`` directory should be, a read-only mount, a full disk), the writer warns once per
``tfdebug`` directory, records the failure in :func:`write_failures`, and returns ``False``. The caller keeps what
it meant to write in memory (``callback.findings``, TensorBoard text, the warning itself) and training goes on.

Only :class:`OSError` (``FileExistsError``, ``PermissionError``, ``ENOSPC``, ``EROFS``...) is absorbed: a bug in what
is written (an object that cannot be serialised) is not a file-system failure and still raises, to be caught by the
callback guard in :mod:`lightning_tfdebug.core.base`.

Every whole-file write is atomic (a temporary file beside the target, flushed, synced and renamed into place), so a
reader sees the old file or the new one, never half of it. Appends (findings, per-rank records) write one complete
line per call and flush it; a process killed mid-line leaves at most one cut last line, which the readers skip.
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
    directory = os.path.dirname(os.path.abspath(path))
    probe = os.path.abspath(path)
    while True:
        if os.path.basename(probe) == "tfdebug":
            return probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return directory
        probe = parent


def refused(path: str | os.PathLike[str], err: OSError, *, warn: bool = True) -> WriteFailure:
    """Record that the file system refused a write to ``path`` and warn once per ``tfdebug`` directory.

    For writes this module does not make itself (a TensorBoard writer's flush): the same one warning, the same
    record in :func:`write_failures`. ``warn=False`` only records it (a command line that reports the error itself).
    """
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
            stacklevel=4,
        )
    return failure


def _refused(path: str, err: OSError, warn: bool = True) -> None:
    refused(path, err, warn=warn)


def make_dirs(directory: str | os.PathLike[str]) -> bool:
    """Create ``directory`` and its parents; False (warned once) when the file system refuses."""
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        return True
    except OSError as err:
        _refused(directory, err)
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

    ``write`` receives a path (so ``torch.save``, a profiler's ``export_chrome_trace`` or a text writer can all use
    it). The temporary file is removed if anything fails. Returns False (warned once; with ``warn=False`` only
    recorded in :func:`write_failures`) when the file system refuses; any other exception from ``write`` propagates.
    The file gets the mode an ordinary ``open(path, "w")`` would give it (``0o666`` less the umask): a temporary
    file is created ``0o600``, and teammates on a shared cluster must be able to read the report.
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
        _refused(path, err, warn)
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
    """Append one line (a newline is added) to ``path`` and flush it; False (warned once) when refused.

    The line is written with a single ``write`` on a file opened in append mode, so several writers can share a file
    and nothing earlier is overwritten. ``sync`` also calls ``fsync`` (findings: rare and precious).
    """
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
        _refused(path, err)
        return False


def publish_dir(build: Callable[[str], None], root: str | os.PathLike[str], name: str) -> str | None:
    """Build a directory with ``build(tmp_dir)`` and rename it to ``root/name`` (``name-1``, ``name-2``... if taken).

    The directory appears complete or not at all, never replaces an earlier one, and gets the mode ``os.makedirs``
    would give it under the umask. Returns its path, or None
    (warned once) when the file system refuses; any other exception from ``build`` propagates.
    """
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
        _refused(os.path.join(root, name), err)
        return None
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "WriteFailure",
    "append_line",
    "make_dirs",
    "process_umask",
    "publish_dir",
    "refused",
    "write_atomic",
    "write_failures",
    "write_text",
]


def append_finding(path: str | os.PathLike[str], finding: Finding) -> bool:
    """Append one finding as a JSON line and flush it to disk at once; False when the file system refused.

    The file is opened in append mode for each finding (findings are rare), so several callbacks can share it and
    nothing written earlier is ever overwritten. A refused write warns once (see :func:`append_line`)
    and never raises: the finding is still held by the callback that made it.
    """
    return append_line(path, finding.to_json())
