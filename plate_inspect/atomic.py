"""The one atomic file writer: readers see the old file or the new one, never half of one.

The temporary file is created next to the target with ``O_CREAT | O_EXCL`` and mode 0o666, so the kernel applies
the process umask and the directory's default ACLs to it exactly as to any new file: after the rename the file has
the mode a plain ``open(path, "w")`` would have given it. Nothing reads or changes the process umask (``os.umask``
is a process-wide write, unsafe with threads).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` via a fsynced temp file in the same directory and an atomic rename.

    Raises OSError (after removing the temp file) so that each caller can word the error for its own users.
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = _create_temp(parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(parent)
    return path


def _create_temp(parent: Path, name: str) -> tuple[int, Path]:
    """A new, exclusively created temp file ``.<name>.<random>.tmp`` in ``parent`` (mode 0o666 minus the umask)."""
    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: cannot create a unique temporary file for {name}")


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable where the platform allows it (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
