"""The bundle writer's one-line I/O errors: worded from the errno table in plate_inspect.errors (OS_FAULTS)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from plate_inspect import bundle_writer
from plate_inspect.errors import BundleError


def _failing_write(no: int, why: str):
    def write(path, data):
        raise OSError(no, why, str(path))

    return write


@pytest.mark.parametrize(
    ("no", "why", "expected"),
    [
        (errno.ENOSPC, "No space left on device", "disk full while writing the bundle; free space and rerun to resume"),
        # a quota is a full disk for this user: the same mend (before: "cannot write (Disk quota exceeded)")
        (
            errno.EDQUOT,
            "Disk quota exceeded",
            "Disk quota exceeded while writing the bundle; free space and rerun to resume",
        ),
        (
            errno.EACCES,
            "Permission denied",
            "output directory is not writable (Permission denied); choose another --out",
        ),
        (
            errno.EROFS,
            "Read-only file system",
            "output directory is not writable (Read-only file system); choose another --out",
        ),
        (errno.EIO, "Input/output error", "cannot write (Input/output error)"),
    ],
)
def test_write_file_words_each_errno(monkeypatch, tmp_path: Path, no: int, why: str, expected: str):
    monkeypatch.setattr(bundle_writer, "atomic_write", _failing_write(no, why))
    target = tmp_path / "manifest.json"
    with pytest.raises(BundleError) as caught:
        bundle_writer.write_file(target, "{}")
    assert str(caught.value) == f"{target}: {expected}"
