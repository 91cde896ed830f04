"""The one atomic file writer: readers see the old file or the new one, never half of one.

The temporary file is created next to the target with ``O_CREAT | O_EXCL`` and mode 0o666, so the kernel applies
the process umask and the directory's default ACLs to it exactly as to any new file: after the rename the file has
the mode a plain ``open(path, "w")`` would have given it. Nothing reads or changes the process umask (``os.umask``
is a process-wide write, unsafe with threads).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` via a fsynced temp file in the same directory and an atomic rename.

    Raises OSError (after removing the temp file) so that each caller can word the error for its own users; its
    ``filename`` is ``path``, never the temp file's name, which means nothing to a user.
    """
    path = Path(path)
    refuse_special_file(path)
    payload = data.encode() if isinstance(data, str) else data
    parent = path.parent if str(path.parent) else Path(".")
    tmp = None
    try:
        fd, tmp = _create_temp(parent, path.name)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    _fsync_dir(parent)
    return path


def refuse_special_file(path: Path) -> None:
    """OSError for a target that exists but is no regular file (a device such as /dev/null, a FIFO, a socket,
    a directory): the rename would replace it with a plain file (as root, /dev/null itself). Symlinks to regular
    files are allowed (the rename replaces the link, as with any atomic writer)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError:
        return  # unreadable: the write below reports the real reason
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file (a device, FIFO or socket); give a file path", str(path))


def _create_temp(parent: Path, name: str) -> tuple[int, Path]:
    """A new, exclusively created temp file ``.<name>.<random>.tmp`` in ``parent`` (mode 0o666 minus the umask)."""
    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: cannot create a unique temporary file for {name}")


def stale_temps(parent: str | os.PathLike, name_glob: str) -> list[Path]:
    """Temp files of :func:`atomic_write` for names matching ``name_glob`` in ``parent``: a writer killed mid-write
    (SIGKILL, power loss) leaves one; only a caller that knows no writer of those names is running may remove them."""
    return sorted(p for p in Path(parent).glob(f".{name_glob}.*.tmp") if _TEMP_NAME.fullmatch(p.name))


_TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")


def make_temp_dir(parent: str | os.PathLike, name: str) -> Path:
    """A new, empty directory ``.<name>.partial-<random>`` in ``parent``, created with mode 0o777 so that the umask
    and default ACLs apply as to any new directory (``tempfile.mkdtemp`` gives 0o700: wrong once renamed)."""
    parent = Path(parent)
    for _ in range(100):
        tmp = parent / f".{name}.partial-{secrets.token_hex(6)}"
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: cannot create a unique temporary directory for {name}")


def new_file_mode(directory: str | os.PathLike) -> int:
    """The permission bits a new file in ``directory`` gets (0o666 minus the umask, or the default ACL's), read
    from a probe file: for files a library wrote with another mode (safetensors' save_file: 0o600)."""
    fd, probe = _create_temp(Path(directory), "mode-probe")
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        os.unlink(probe)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable where the platform allows it (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dirs(path: str | os.PathLike, what: str, option: str = "--out") -> Path:
    """``mkdir -p path`` for an output directory; ConfigError (one line: the path, why, ``option`` to change) when
    it cannot be made: a file in the way, no permission, a read-only or full disk."""
    from plate_inspect.errors import ConfigError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot create {what} ({os_error_reason(path, e)}); choose another {option}"
        ) from None
    return path


def os_error_reason(path: str | os.PathLike, e: OSError) -> str:
    """A short reason for an OSError on an output path: names the file in the way where a directory was needed."""
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        for p in (Path(path), *Path(path).parents):
            if p.exists() and not p.is_dir():
                return f"{p} is a file, not a directory"
    if e.errno == errno.ENOSPC:
        return "disk full"
    return str(e.strerror or e)
