"""Every error plate-inspect raises for a user mistake or bad input; the CLI prints one line (exit 2), no traceback.

One hierarchy, grouped by domain, so callers can catch broadly (``PlateInspectError``) or precisely
(``HubRepoNotFoundError``)::

    PlateInspectError
    ├── ConfigError                     a setting is out of range or inconsistent (every command, every API)
    ├── CheckpointError                 a checkpoint cannot be found or read, or is not what it claims to be
    │   ├── CorruptCheckpointError      a safetensors header/index/config that breaks the format's rules
    │   ├── UnsupportedWeightError      storage plate-inspect does not analyse (GPTQ/AWQ/bnb, integer, pickle)
    │   └── HubError                    the Hugging Face hub could not provide the files
    │       ├── HubRepoNotFoundError    no such repository (or it is private and no token grants access)
    │       ├── HubGatedRepoError       the repository is gated: accept its terms, log in
    │       ├── HubRevisionNotFoundError  the repository exists, the revision does not
    │       ├── HubUnauthorizedError    the token is missing, invalid or lacks access
    │       └── HubOfflineError         offline (by setting or no connection) and not in the local cache
    ├── BundleError                     a bundle is missing, incomplete, corrupt, or made for other weights
    ├── AnalysisError                   an analysis cannot run on the given model or data
    │   ├── AlignmentError
    │   └── CurvatureError
    └── ReportError                     the report cannot be written
        └── BrowserError                Chromium is missing, failed to start, or did not answer
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Messages name a keyword argument with its CLI flag as "overwrite=True (CLI: --overwrite)" (a string value as
#: 'devices="all" (CLI: --devices all)'); the CLI shows the flag.
_FLAG = r"(--[\w-]+(?: [\w:,.-]+)?)"
_KEYWORD_AND_FLAG = re.compile(r'\b\w+=(?:\w+|"[^"]*") \(CLI: ' + _FLAG + r"\)")
_FLAG_NOTE = re.compile(r"\(CLI: " + _FLAG + r"\)")
#: An argument with its CLI argument's name: "source (CLI: MODEL)"; the CLI shows MODEL.
_ARGUMENT_AND_NAME = re.compile(r"\b\w+ \(CLI: ([A-Z][A-Z_]*)\)")


def cli_text(message: str) -> str:
    """A message as the CLI prints it: ``overwrite=True (CLI: --overwrite)`` -> ``--overwrite``,
    ``device="cpu" (CLI: --device cpu)`` -> ``--device cpu``, ``(CLI: --out)`` -> ``(--out)``, ``source (CLI:
    MODEL)`` -> ``MODEL``; the Python API keeps both forms."""
    message = _ARGUMENT_AND_NAME.sub(r"\1", message)
    return _FLAG_NOTE.sub(r"(\1)", _KEYWORD_AND_FLAG.sub(r"\1", message))


@dataclass(frozen=True)
class OsFault:
    """How plate-inspect words an OSError of one errno, for each kind of caller (:data:`OS_FAULTS`)."""

    todo: str  # what to do, for any file named in the error (os_error_advice, os_error_text)
    reason: str | None = None  # a short reason in place of the system's strerror ("disk full"; os_error_reason)
    mend: str = "mend that"  # what to mend before rerunning a write that resumes (the continual runs)
    space: bool = False  # out of space: freeing some and rerunning resumes the write (the bundle writer)
    denied: bool = False  # this place may not be written: choose another (the bundle writer)


_DENIED = OsFault(
    "check the permissions of it and of its directories (ls -ld), or run as a user who may use it",
    mend="let this user write there (ls -ld shows who may)",
    denied=True,
)

#: The one table of errno -> wording: each caller takes the column it needs (a read names ``todo``, a writer that
#: resumes ``mend``, the bundle writer ``space``/``denied``); an errno not listed gets :data:`_OTHER_FAULT`.
OS_FAULTS: dict[int, OsFault] = {
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
    errno.EROFS: OsFault(
        "it is on a read-only file system: choose a place on a writable one",
        mend="make that file system writable",
        denied=True,
    ),
    errno.ENOSPC: OsFault("the disk is full: free space and rerun", reason="disk full", mend="free space", space=True),
    errno.EDQUOT: OsFault("the disk quota is used up: free space and rerun", mend="free space", space=True),
    errno.ENOENT: OsFault("check the path"),
    errno.EISDIR: OsFault("it is a directory: give a file"),
    errno.ENOTDIR: OsFault("a part of the path is a file, not a directory: check the path"),
    errno.ENAMETOOLONG: OsFault("give a shorter path"),
    errno.ELOOP: OsFault("a symbolic link in the path points back at itself: check the path"),
}
_OTHER_FAULT = OsFault("check the path and rerun")


def os_fault(e: OSError) -> OsFault:
    """The wording of ``e``'s errno (:data:`OS_FAULTS`)."""
    return OS_FAULTS.get(e.errno or 0, _OTHER_FAULT)


def os_error_text(e: OSError) -> str | None:
    """The one line the CLI prints for an OSError on a named file that no command turned into its own error (a
    model directory it may not list, a file it may not read): the file, why, what to do. None for an OSError that
    names no file: that is not the user's input, so the traceback stays."""
    if e.filename is None:
        return None
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"{where}: {e.strerror or type(e).__name__}; {os_error_advice(e)}"


def dangling_link(path: str | os.PathLike) -> str | None:
    """What to say of ``path`` when it is a symbolic link to nothing, else None: the link's target, and the mend. In
    a Hugging Face cache (``models--ORG--NAME/snapshots/COMMIT/FILE -> ../../blobs/HASH``) the blob is missing (a
    download interrupted or pruned): the ``hf download`` command that fetches it again, as hub.py words a missing
    shard."""
    link = Path(path)
    if not link.is_symlink() or link.exists():
        return None
    target = os.readlink(link)
    parts = Path(os.path.abspath(link)).parts
    at = len(parts) - 1 - parts[::-1].index("snapshots") if "snapshots" in parts else -1
    if 1 <= at < len(parts) - 2 and parts[at - 1].startswith("models--"):
        repo = parts[at - 1].removeprefix("models--").replace("--", "/")
        file, commit = "/".join(parts[at + 2 :]), parts[at + 1]
        return (
            f"it is a link into the Hugging Face cache ({target}) whose blob is missing (a download interrupted or "
            f"the cache pruned); download it again on a connected machine with: hf download {repo} {file} "
            f"--revision {commit}"
        )
    where = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(link)), target))
    return (
        f"it is a symbolic link to {target} ({where}), which does not exist: restore that file, or re-create the link"
    )


def os_error_advice(e: OSError) -> str:
    """What to do about ``e`` (by errno: permissions, a read-only or full disk, a wrong path), for messages that
    word the failure themselves ("cannot read: Permission denied; <advice>")."""
    if e.errno == errno.ENOENT and e.filename is not None:
        link = dangling_link(os.fsdecode(e.filename))
        if link is not None:
            return link
    if e.errno in (errno.EACCES, errno.EPERM) and e.filename is not None:
        closed = _closed_directory(os.fspath(e.filename))
        if closed is not None:  # name the directory in the way, not only the file asked for inside it
            return (
                f"this user may not enter the directory {closed} (ls -ld {closed}): change its permissions, or run as "
                "a user who may"
            )
    return os_fault(e).todo


def _closed_directory(path: str | bytes) -> str | None:
    """The outermost existing directory on ``path`` that this process may not enter (no search permission), if any."""
    path = os.path.abspath(os.fsdecode(path))
    parents = []
    head = os.path.dirname(path)
    while head and head not in parents:
        parents.append(head)
        head = os.path.dirname(head)
    for directory in reversed(parents):
        if os.path.isdir(directory) and not os.access(directory, os.X_OK):
            return directory
    return None


def refuse_to_replace(
    path: str | os.PathLike,
    is_ours: Callable[[Path], bool],
    what: str,
    thing: str,
    option: str,
    example: str,
    error: type[PlateInspectError] | None = None,
) -> None:
    """The one rule for an output file that already exists: replace it only when ``is_ours(path)`` (an earlier
    output of the same kind, ``what``: "an HTML page", "a plan JSON"); anything else (a bundle's manifest, a model's
    weights, the user's data) is refused in one line: ``thing`` ("the plan") would replace it, give another
    ``option``, e.g. ``example``. ``error``: the class raised (default ConfigError)."""
    path = Path(path)
    if path.is_file() and not is_ours(path):
        raise (error or ConfigError)(
            f"{path}: exists and is not {what} ({thing} would replace it: a bundle's manifest, a model's weights, "
            f"your data); choose another {option}, e.g. {option} {example}"
        )


def json_file_holds(path: Path, accept: Callable[[object], bool]) -> bool:
    """Whether ``path`` is a JSON file whose value ``accept`` recognises (an earlier output: it may be replaced)."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return bool(accept(value))


class PlateInspectError(Exception):
    """Base class: the message says what went wrong, where (file/tensor), and what to do.

    The message is always one printable line: control characters that came from the input (a tensor name with a
    newline in a corrupt header) are shown escaped.
    """

    def __str__(self) -> str:
        text = super().__str__()
        return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ConfigError(PlateInspectError):
    """A setting is out of range or inconsistent."""


# --------------------------------------------------------------------------- checkpoints
class CheckpointError(PlateInspectError):
    """The checkpoint cannot be found, read, or is not what it claims to be."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors header, shard index or config.json that breaks the format's rules (or a truncated file)."""


class UnsupportedWeightError(CheckpointError):
    """A weight is stored in a form plate-inspect does not analyse (packed quantized, integer, pickle)."""


class HubError(CheckpointError):
    """The Hugging Face hub could not provide the checkpoint's files."""


class HubRepoNotFoundError(HubError):
    """The repository does not exist (or is private and the token does not grant access)."""


class HubGatedRepoError(HubError):
    """The repository is gated: its terms must be accepted on the hub, with a token."""


class HubRevisionNotFoundError(HubError):
    """The repository exists but the requested revision (branch, tag, commit) does not."""


class HubUnauthorizedError(HubError):
    """The hub refused the token (missing, invalid, or without access)."""


class HubOfflineError(HubError):
    """Offline (by setting or because the hub cannot be reached) and the files are not all in the local cache."""


# --------------------------------------------------------------------------- bundles
class BundleError(PlateInspectError):
    """A bundle is missing, incomplete, corrupt, or made for other weights or settings."""


# --------------------------------------------------------------------------- analyses
class AnalysisError(PlateInspectError):
    """An analysis cannot run on the given model, data or bundle."""


class AlignmentError(AnalysisError):
    """The alignment analysis cannot run on the given model, inputs or settings."""


class CurvatureError(AnalysisError):
    """A curvature analysis cannot run with the given model, family or data."""


# --------------------------------------------------------------------------- reports
class ReportError(PlateInspectError):
    """The report cannot be written (bad output path, unwritable directory)."""


class BrowserError(ReportError):
    """Chromium is missing, failed to start, or did not answer."""
