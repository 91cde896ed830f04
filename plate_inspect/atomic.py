"""The one atomic file writer: readers see the old file or the new one, never half of one.

The temporary file is created next to the target with ``O_CREAT | O_EXCL`` and mode 0o666, so the kernel applies
the process umask and the directory's default ACLs to it exactly as to any new file: after the rename the file has
the mode a plain ``open(path, "w")`` would have given it. Nothing reads or changes the process umask (``os.umask``
is a process-wide write, unsafe with threads).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# an argument check, at home in arguments; importable from here as before (train, experiments, plan, checkpoint, ...)
from plate_inspect.arguments import path_argument as path_argument


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


@dataclass
class TempDir:
    """A directory of :func:`make_temp_dir` and the lock its writer holds on the lock file beside it
    (``<dir>.lock``, see :func:`temp_dir_lock`) until :meth:`release`.

    The lock is an flock: the kernel drops it when the writer dies, SIGKILL included, so a later writer that can
    take it (:func:`claim_temp_dir`) knows the directory is a dead writer's leftover."""

    path: Path
    lock_fd: int | None  # None: no flock on this filesystem (some network mounts); no lock file was left then

    def release(self) -> None:
        """Remove the lock file and drop the lock; call once ``path`` was renamed away or deleted."""
        if self.lock_fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_dir_lock(self.path))
        finally:  # the lock goes even when the unlink fails: a leftover lock file is cleared by the next claimant
            os.close(self.lock_fd)
            self.lock_fd = None


def make_temp_dir(parent: str | os.PathLike, name: str) -> TempDir:
    """A new, empty directory ``.<name>.partial-<random>`` in ``parent``, created with mode 0o777 so that the umask
    and default ACLs apply as to any new directory (``tempfile.mkdtemp`` gives 0o700: wrong once renamed), and
    locked for its writer's lifetime (:class:`TempDir`): its lock file is created and flocked before the directory
    exists, so a directory with a lock file nobody holds is a dead writer's. Where the filesystem has no flock, no
    lock file is left: such a directory counts as unknown (:func:`claim_temp_dir`), never as dead."""
    parent = Path(parent)
    for _ in range(100):
        tmp = parent / f".{name}.partial-{secrets.token_hex(6)}"
        lock = temp_dir_lock(tmp)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o666)
        except FileExistsError:
            continue
        temp = TempDir(tmp, fd)
        try:
            taken = _try_flock(fd)
            if taken is None:  # no flock here: no lock file either, so nobody takes this directory for dead
                temp.release()
            elif not taken or not _same_file(fd, lock):  # a claimant clearing it as an orphan got there first
                os.close(fd)
                continue
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            temp.release()
            continue
        except BaseException:
            temp.release()
            raise
        return temp
    raise FileExistsError(f"{parent}: cannot create a unique temporary directory for {name}")


def temp_dir_lock(directory: str | os.PathLike) -> Path:
    """The lock file of a :func:`make_temp_dir` directory: beside it, ``<its name>.lock`` (never inside it: the
    directory is renamed into place as it is)."""
    directory = Path(directory)
    return directory.with_name(directory.name + ".lock")


class Claim(enum.Enum):
    """What :func:`claim_temp_dir` found out about a temporary directory's writer."""

    DEAD = "dead"  # its lock was free and is now held by the claimant: nobody else renames or writes the directory
    LIVE = "live"  # a running writer (or another claimant) holds the lock
    UNKNOWN = "unknown"  # no lock file (an older version, a filesystem without flock) or it cannot be opened/locked


@contextlib.contextmanager
def claim_temp_dir(directory: str | os.PathLike) -> Iterator[Claim]:
    """Try to take the lock of a :func:`make_temp_dir` directory (``.X.partial-R``) without waiting, and hold it
    for the ``with`` block: :attr:`Claim.DEAD` means its writer died and the caller alone may now delete or rename
    the directory (check that it still exists first: a claimant before may have). With :attr:`Claim.DEAD`, the lock
    file is removed when the block ends, unless ``directory`` is still there (deleting it failed: the next claimant
    retries). The lock file is opened without following links and must be a regular file; it is opened for writing
    where permitted, since NFS implements flock as a POSIX lock, which needs that for an exclusive lock."""
    lock = temp_dir_lock(directory)
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
    fd = None
    for mode in (os.O_RDWR, os.O_RDONLY):  # read-only: another user's lock file, a read-only filesystem
        try:
            fd = os.open(lock, mode | flags)
            break
        except OSError as e:  # missing, a link, unreadable (another user's, mode 0600)
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                break
    if fd is None:
        yield Claim.UNKNOWN
        return
    try:
        taken = _try_flock(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        if taken and not _same_file(fd, lock):
            taken = False  # the lock file was removed (and maybe made anew) since it was opened: someone else's now
        yield Claim.UNKNOWN if taken is None else Claim.DEAD if taken else Claim.LIVE
        if taken and not os.path.lexists(directory):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)  # before the lock is dropped: a later claimant's open fails or sees another inode
    finally:
        os.close(fd)


def _try_flock(fd: int) -> bool | None:
    """An exclusive flock on ``fd`` without waiting: True taken, False held by another open file, None where the
    platform or filesystem has no flock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP, ...: some network and FUSE filesystems
        return None
    return True


def _same_file(fd: int, path: Path) -> bool:
    """True when ``path`` still names the file open as ``fd`` (a lock file is not removed and made anew)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
    from plate_inspect.errors import os_fault

    return os_fault(e).reason or str(e.strerror or e)
