"""core.io: the one writer of the pack's files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_tfdebug.core import io


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert io.process_umask() == umask
        assert io.write_text(tmp_path / "report.html", "<html></html>")
        assert io.write_atomic(tmp_path / "weights.bin", lambda p: Path(p).write_bytes(b"0"))
    finally:
        os.umask(old)
    for name in ("report.html", "weights.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert (tmp_path / "report.html").read_text() == "<html></html>"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_published_directory_honours_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        built = io.publish_dir(lambda d: io.write_text(os.path.join(d, "a.txt"), "a"), tmp_path, "bundle")
    finally:
        os.umask(old)
    assert built is not None and stat.S_IMODE(os.stat(built).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(os.path.join(built, "a.txt")).st_mode) == 0o644


def test_a_refused_write_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "x.txt"

    def fail(path: str) -> None:
        raise OSError(28, "No space left on device")

    assert not io.write_atomic(target, fail, warn=False)
    assert not target.exists() and not list(tmp_path.iterdir())
