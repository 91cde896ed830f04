"""Hugging Face hub repos as local snapshot directories, for :meth:`plate_inspect.checkpoint.Checkpoint.open`.

The local cache first; else the ``*.json`` files, then only the weight files the checkpoint reader will open
(:func:`hub_weight_files`, the reader's own rule). Every failure is one :class:`~plate_inspect.errors.HubError`
subclass per cause with a one-line message: not found, gated, revision not found, unauthorized, offline.
``huggingface_hub`` is imported only when a repo is resolved.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
from pathlib import Path

from plate_inspect.checkpoint import INDEX_FILE, SINGLE_FILE, read_weight_map, single_file_is_read
from plate_inspect.errors import (
    ConfigError,
    CorruptCheckpointError,
    HubError,
    HubGatedRepoError,
    HubOfflineError,
    HubRepoNotFoundError,
    HubRevisionNotFoundError,
    HubUnauthorizedError,
)


def looks_like_repo_id(s: str) -> bool:
    """Whether ``s`` has a hub repo id's shape, 'owner/name' (a source that is no existing path is tried as one)."""
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))


def resolve_hub_snapshot(repo_id: str, revision: str | None = None, offline: bool | None = None) -> tuple[Path, str]:
    """Local snapshot dir of a hub repo and its commit: the HF cache first; else download the ``*.json`` files
    (config, index, tokenizer), then only the weight files the reader will open (:func:`hub_weight_files`): a
    repo shipping ``consolidated.safetensors`` beside its shards is not downloaded twice.

    Raises one :class:`HubError` subclass per cause, each a one-line message: repository not found, gated,
    revision not found, unauthorized (401/403), and offline (by setting or no connection) with the files missing.
    """
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import snapshot_download

    meta = ["*.json"]  # which weight files a cached snapshot needs is _missing_files' business (the reader's rule)
    revision = _expand_cached_commit(repo_id, revision, hf_constants.HF_HUB_CACHE)
    cached = _cached_snapshot(repo_id, revision, meta)
    if cached is not None and _snapshot_complete(cached):
        return cached, cached.name
    is_offline = offline if offline is not None else bool(hf_constants.HF_HUB_OFFLINE)
    cache = hf_constants.HF_HUB_CACHE
    if is_offline:
        raise HubOfflineError(
            f"{_not_cached(repo_id, cached, cache, revision)} and offline mode is on; "
            f"{_fetch_hint(repo_id, revision, cached)}"
        )
    try:
        small = Path(snapshot_download(repo_id, revision=revision, allow_patterns=meta))
        weights = [glob.escape(f) for f in _hub_weights_to_fetch(repo_id, small)]  # patterns: names taken literally
        path = Path(snapshot_download(repo_id, revision=small.name, allow_patterns=meta + weights))  # same commit
    except CorruptCheckpointError:  # a corrupt index: said before a weight is downloaded
        raise
    except Exception as e:  # noqa: BLE001 - mapped to one message per cause; the rest is "cannot reach"
        raise _hub_error(e, repo_id, revision, cached, cache) from None
    if not _snapshot_complete(path):  # huggingface_hub falls back to the cached snapshot when the hub is unreachable
        raise HubOfflineError(
            f"{_not_cached(repo_id, path, cache, revision)}, and the hub did not provide them (it cannot be reached, "
            f"or the repository lacks them); {_fetch_hint(repo_id, revision, path)}"
        )
    return path, path.name


def hub_weight_files(files: list[str], weight_map: dict[str, str] | None) -> list[str]:
    """The weight files a checkpoint directory holding ``files`` is read from (the rule ``Checkpoint.open`` applies
    to a local directory, and transformers' from_pretrained): ``model.safetensors`` when present and not one of the
    index's shards, else the index's shards (``weight_map``: tensor -> file), else every top-level
    ``*.safetensors``. Anything else (Mistral's ``consolidated.safetensors``, an ``original/`` folder) is not read."""
    top = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if single_file_is_read(SINGLE_FILE in top, None if weight_map is None else weight_map.values()):
        return [SINGLE_FILE]
    if weight_map is not None:
        return sorted(set(weight_map.values()))
    return top


def _hub_weights_to_fetch(repo_id: str, snapshot: Path) -> list[str]:
    """:func:`hub_weight_files` for the repo at ``snapshot``'s commit, whose ``*.json`` files (the index) are in
    ``snapshot`` already; the repo's file list comes from the hub (its errors are the caller's to word)."""
    from huggingface_hub import list_repo_files

    files = list_repo_files(repo_id, revision=snapshot.name)
    index = snapshot / INDEX_FILE
    return hub_weight_files(files, read_weight_map(index) if INDEX_FILE in files and index.is_file() else None)


def _not_cached(repo_id: str, cached: Path | None, cache: str, revision: str | None = None) -> str:
    """'<repo>: not (fully) in the local cache (...; missing: ...)', and when nothing is cached, not a local path;
    when the cache holds the repo at other revisions only, which ones (the user may mean one of them)."""
    if cached is None and (held := _cached_revisions(repo_id, cache)):
        return (
            f"{repo_id}: revision '{revision or 'main'}' is not in the local Hugging Face cache ({cache}; it holds "
            f"this repo at {held}: --revision takes a branch or tag listed there, or a commit listed there (a "
            "unique prefix will do))"
        )
    if cached is None:  # a mistyped local path reads as a repo id: say it is neither
        return (
            f"{repo_id}: not in the local Hugging Face cache ({cache}; missing: the whole repo), nor is it a local "
            "path (for a local model, check the path),"
        )
    return (
        f"{repo_id}: not fully in the local Hugging Face cache ({cache}; missing: {', '.join(_missing_files(cached))})"
    )


def _expand_cached_commit(repo_id: str, revision: str | None, cache: str) -> str | None:
    """A short commit ('0123abc', as ``git log --oneline`` prints it) that starts exactly one cached snapshot of the
    repo, as that full commit (huggingface_hub looks snapshots up by full commit only); anything else unchanged.
    A prefix of several cached commits is refused, naming them; a branch or tag of that name wins."""
    if revision is None or not re.fullmatch(r"[0-9a-f]{4,39}", revision):
        return revision
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if (folder / "refs" / revision).is_file():
        return revision
    found = sorted(p.name for p in (folder / "snapshots").glob(f"{revision}*") if p.is_dir())
    if len(found) > 1:
        raise ConfigError(
            f"{repo_id}: revision '{revision}' starts {len(found)} cached commits ({', '.join(found[:4])}); give "
            "more of the commit"
        )
    return found[0] if found else revision


def _cached_revisions(repo_id: str, cache: str, most: int = 4) -> str:
    """The revisions a cache holds of a repo ('main -> 0123abcd..., snapshots 0123abcd..., 4567ef01...'), or ''."""
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshots = sorted(p.name for p in (folder / "snapshots").glob("*") if p.is_dir())
    if not snapshots:
        return ""
    refs = []
    for ref in sorted((folder / "refs").rglob("*")):
        if ref.is_file():
            try:
                commit = ref.read_text().strip()
            except (OSError, UnicodeDecodeError):
                continue
            refs.append(f"{ref.relative_to(folder / 'refs').as_posix()} -> {commit}")
    listed = ", ".join(snapshots[:most]) + (f" and {len(snapshots) - most} more" if len(snapshots) > most else "")
    return (", ".join(refs) + "; " if refs else "no branch or tag (refs/ is empty); ") + f"snapshots {listed}"


#: At most this many missing weight files are named in the download command; more are fetched by pattern.
_HINT_FILES = 4


def _fetch_hint(repo_id: str, revision: str | None, cached: Path | None) -> str:
    """The ``hf download`` command that fetches what the reader needs: the missing shards by name when the cache
    knows them (a few), else the top-level *.json and *.safetensors without the files the reader never opens
    (Mistral's ``consolidated.safetensors``, an ``original/`` folder: a whole second copy of the weights)."""
    rev = f" --revision {revision}" if revision else ""
    missing = _missing_files(cached) if cached is not None else []
    if missing and len(missing) <= _HINT_FILES and all(_is_file_name(m) for m in missing):
        names = " ".join(map(shlex.quote, missing))
        return f"download them on a connected machine with: hf download {repo_id} {names}{rev}"
    what = "the repo" if cached is None else "the missing files"
    return (
        f"download {what} on a connected machine with: hf download {repo_id} --include '*.safetensors' '*.json' "
        f"--exclude 'consolidated*' '*/*'{rev}"
    )


def _is_file_name(name: str) -> bool:
    """A plain file name (not a pattern such as '*.safetensors' or a note such as '... (corrupt)')."""
    return not re.search(r"[*?\[\s]", name)


def _cached_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - anything that is not a cache hit is a miss
        # a recent huggingface_hub refuses a snapshot its cached listing shows incomplete, but says where it is: the
        # partial snapshot, so that the message names the missing files (not "the whole repo")
        partial = getattr(e, "snapshot_path", None)
        return Path(partial) if isinstance(partial, str) and Path(partial).is_dir() else None


def _hub_error(e: Exception, repo_id: str, revision: str | None, cached: Path | None, cache: str) -> HubError:
    """One message per cause: huggingface_hub's error types, then the HTTP status, then connection failures."""
    from huggingface_hub import errors as hf

    # snapshot_download wraps some hub answers (403, 5xx) in LocalEntryNotFoundError: classify the cause
    cause = e.__cause__ if isinstance(e, hf.LocalEntryNotFoundError) and e.__cause__ is not None else e
    if isinstance(cause, (hf.GatedRepoError, hf.RepositoryNotFoundError, hf.RevisionNotFoundError, hf.HfHubHTTPError)):
        e = cause
    status = getattr(getattr(e, "response", None), "status_code", None)
    rev = revision or "main"
    if isinstance(e, hf.HFValidationError):
        return HubRepoNotFoundError(
            f"{repo_id}: no such local path, and not a valid hub repo id ('owner/name'); check the spelling, or give "
            "a local model as an existing path"
        )
    if isinstance(e, hf.GatedRepoError):
        return HubGatedRepoError(
            f"{repo_id}: the repository is gated: accept its terms on https://huggingface.co/{repo_id} and log in "
            "(hf auth login, or set HF_TOKEN)"
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return HubRepoNotFoundError(
            f"{repo_id}: repository not found on the hub (check the name; a private repo needs a token with access: "
            "hf auth login or HF_TOKEN)"
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return HubRevisionNotFoundError(
            f"{repo_id}: revision '{rev}' not found (the repository exists; check the branch, tag or commit)"
        )
    if status in (401, 403):
        return HubUnauthorizedError(
            f"{repo_id}: the hub refused access (HTTP {status}): the token is missing, invalid or lacks access to "
            "this repository; log in (hf auth login) or set HF_TOKEN"
        )
    if isinstance(e, hf.HfHubHTTPError) and status is not None:
        return HubError(f"{repo_id}: the hub answered HTTP {status} for revision '{rev}'; try again later")
    return HubOfflineError(
        f"{_not_cached(repo_id, cached, cache, revision)} and the hub cannot be reached ({type(e).__name__}); "
        f"{_fetch_hint(repo_id, revision, cached)}"
    )


def _snapshot_complete(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors")) and not _missing_files(path)


def _missing_files(path: Path) -> list[str]:
    index = path / INDEX_FILE
    if not index.exists():
        return [] if any(path.glob("*.safetensors")) else ["*.safetensors"]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {s for s in weight_map.values() if isinstance(s, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ["model.safetensors.index.json (corrupt)"]
    if single_file_is_read((path / SINGLE_FILE).exists(), shards):  # read instead of the shards
        return []
    return sorted(s for s in shards if not (path / s).exists())
