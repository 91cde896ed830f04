"""Sequential PLATE (paper, Algorithm "Sequential PLATE"): merge a trained adapter, write, rescan.

``merge_checkpoint(source, adapter, out)`` streams the source checkpoint shard by shard, adds rho B A Q^T to the
bundle's modules (in float32, rounded once to the stored dtype, in the stored layout: ``[d_in, d_out]`` for
GPT-2 Conv1D), and writes safetensors files with the same file names, tensor names and dtypes; ``config.json``
and the other small JSON/tokenizer/chat-template files (and a remote-code model's ``*.py``) are copied.
``sequential_step`` then rescans the merged checkpoint with :func:`plate_inspect.scan` (same settings as the
previous bundle) so the next task starts from fresh B and Q.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import errno
import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from plate_inspect.arguments import bool_argument
from plate_inspect.atomic import Claim, claim_temp_dir, make_temp_dir, new_file_mode, os_error_reason, path_argument
from plate_inspect.bundle import MANIFEST, Bundle, ModuleRecord, ScanSettings
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.dequantize import tensor_from_bytes
from plate_inspect.dtypes import FLOAT_DTYPES, torch_dtype
from plate_inspect.errors import BundleError, CheckpointError, ConfigError
from plate_inspect.formatting import counted, human_bytes
from plate_inspect.model_files import INDEX_FILE
from plate_inspect.progress import ProgressCallback, ProgressCounter
from plate_inspect.targets import EXPERT_LAYOUTS
from plate_inspect.train.core import geometry_digest, merged_copy
from plate_inspect.train.layer import adapter_q_dtype, module_geometry, read_adapter

if TYPE_CHECKING:
    from plate_inspect.scanner import ScanPlan

#: config, index, tokenizer and chat-template files, and a remote-code model's modeling/configuration code (its
#: config.json's auto_map names them: without them from_pretrained(out, trust_remote_code=True) fails)
_COPY_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja", ".py")
#: the weight files save_pretrained writes: the only ones --overwrite may remove besides an index's shards
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


@dataclass
class MergeResult:
    """What merge_checkpoint wrote."""

    out: Path
    files: list[Path]
    merged_modules: list[str]
    bundle: Bundle | None = None  # the rescanned bundle, when asked for
    #: what the user should know (an interrupted merge into ``out`` finished, a fallback to moving files one by one)
    notes: list[str] = field(default_factory=list)


def _stored_name(ckpt: Checkpoint, module: str, record: ModuleRecord) -> str:
    """The tensor a module's merged weight is written to; refused up front where a merge cannot be written."""
    in_model = (
        "merge in the model instead (merge_and_unload() of a PEFT model, plate_inspect.train.layer.unload of "
        "apply_bundle's) and save_pretrained it"
    )
    if record.layout in EXPERT_LAYOUTS:
        raise CheckpointError(
            f"{ckpt.root}: the adapter's module '{module}' is one expert's slice of the 3-D tensor "
            f"'{record.name.rsplit('.', 1)[0]}'; merge writes 2-D weights only, so {in_model}"
        )
    if record.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{ckpt.root}: the adapter's module '{module}' is stored as {record.dtype} (quantized); merging would "
            f"need re-quantizing it, which plate-inspect does not do: {in_model} (in bf16)"
        )
    name = f"{module}.weight"
    if name not in ckpt.tensors:
        raise CheckpointError(f"{ckpt.root}: the adapter's module '{module}' has no tensor '{name}' in this checkpoint")
    return name


def merge_checkpoint(
    source: str | os.PathLike,
    adapter: str | os.PathLike,
    out: str | os.PathLike,
    bundle: Bundle | str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    on_note: Callable[[str], None] | None = None,
) -> MergeResult:
    """Write ``source`` with the adapter merged (W[B] += rho A Q^T) to ``out``: same files, names, dtypes, layout.

    Q is the one the trained layer held (the adapter's ``q_dtypes``: a bf16-held Q is rounded to bf16 as in
    training), so the merged weights equal an in-model merge (``merge_all``/``unload``) bit for bit.

    The adapter's recorded weight fingerprints must match the source's weights and its B/Q digests the bundle's
    (the bundle recorded in the adapter unless ``bundle`` is given); otherwise BundleError. Files are written into
    a temporary directory next to ``out`` and put in place only after every check passed: a failure leaves ``out``
    as it was. An existing ``out`` is replaced as a whole (see :func:`_publish`): after a crash it holds the old or
    the new checkpoint, and the next merge into it finishes or clears what the crash left
    (:func:`finish_interrupted_merge`). ``progress`` gets one event per tensor written (unit "tensors", with bytes
    read); ``on_note`` each note for the user when it arises (what a killed merge left is said before writing), all
    of which the result's ``notes`` also hold.
    """
    out = path_argument(out, "out")
    path_argument(adapter, "adapter")
    bool_argument(overwrite, "overwrite")  # 'no' is truthy: it would replace OUT
    for name, function in (("progress", progress), ("on_note", on_note)):
        if function is not None and not callable(function):  # else a TypeError after the checks, mid-merge
            raise TypeError(f"merge_checkpoint: {name} must be a function, got {type(function).__name__}")
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        if on_note is not None:
            on_note(text)

    for text in finish_interrupted_merge(out):
        note(text)
    ckpt = Checkpoint.open(source)
    tensors_a, meta = read_adapter(adapter)
    b = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle or _recorded_bundle(adapter, meta))
    if out.resolve() == ckpt.root.resolve():
        raise CheckpointError(f"{out}: refusing to overwrite the source checkpoint in place; choose another --out")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory; choose another --out")
    if (out / MANIFEST).exists():  # --overwrite would delete the bundle's parts and leave its manifest behind
        raise CheckpointError(
            f"{out}: holds a PLATE bundle (manifest.json), not a checkpoint; a merged checkpoint needs a directory "
            "of its own, and the bundle is left as it is even with --overwrite; choose another --out"
        )
    if out.exists() and any(out.glob("*.safetensors")) and not overwrite:
        raise CheckpointError(f"{out}: already holds safetensors files; pass overwrite=True (CLI: --overwrite)")
    extras = _files_to_copy(ckpt, Path(source))
    clash = sorted(f.name for f in extras if (out / f.name).exists()) if out.is_dir() and not overwrite else []
    if clash:  # a config.json of something else in --out (``--out .`` in a project) is not replaced unasked
        raise CheckpointError(
            f"{out}: already holds {', '.join(clash[:3])}{', ...' if len(clash) > 3 else ''}, which the merged "
            "checkpoint would replace; pass overwrite=True (CLI: --overwrite) or choose another --out"
        )
    plan: dict[str, tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # stored name -> (module, A, B, Q)
    for module, a in tensors_a.items():
        if module not in b:
            raise BundleError(f"{b.path}: the adapter's module '{module}' is not in this bundle")
        b_idx, q = module_geometry(b, module, meta["k"].get(module), q_dtype=None)  # as stored: the digest's Q
        if meta["plate_digests"].get(module) != geometry_digest(b_idx, q):
            raise BundleError(
                f"{adapter}: module '{module}' was trained with another bundle than {b.path} (B/Q differ)"
            )
        held = adapter_q_dtype(meta["q_dtypes"].get(module, "float32"))  # the Q the trained layer computed with
        plan[_stored_name(ckpt, module, b.record(module))] = (module, a, b_idx, q if held is None else q.to(held))
    by_file: dict[Path, list[str]] = {}
    for name, info in ckpt.tensors.items():
        by_file.setdefault(info.file, []).append(name)
    place = _real_place(out)
    in_place = _no_swap_reason(place)  # out cannot be renamed: the files are built inside it and moved in
    with _write_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        temp = make_temp_dir(place if in_place else place.parent, place.name)  # locked until released below
    tmp = temp.path
    counter = ProgressCounter(
        progress, len(ckpt.tensors), "tensors", bytes_total=sum(i.nbytes for i in ckpt.tensors.values())
    )
    counter.start()
    try:
        merged = []
        for file in ckpt.files:
            names = sorted(by_file.get(file, []), key=lambda n: ckpt.tensors[n].start)
            shard: dict[str, torch.Tensor] = {}
            for name in names:
                info = ckpt.tensors[name]
                if name in plan:
                    module, a, b_idx, q = plan[name]
                    w, fp = ckpt.read(name)
                    if meta["fingerprints"].get(module) != fp:
                        raise BundleError(
                            f"{adapter}: module '{module}' was trained on other weights than {ckpt.root} (fingerprint)"
                        )
                    shard[name] = merged_copy(w, b.record(module).layout, b_idx, a, q, meta["rhos"][module])
                    merged.append(module)
                else:
                    shard[name] = tensor_from_bytes(ckpt.read_bytes(name), _stored_dtype(info.dtype), info.shape)
                counter.step(name, nbytes=info.nbytes)
            with _write_errors(out):
                save_file(shard, str(tmp / file.name), metadata=_header_metadata(file) or None)
            del shard
        with _write_errors(out):
            for extra in extras:
                shutil.copy2(extra, tmp / extra.name)
            mode = new_file_mode(tmp)  # save_file writes 0o600, copy2 keeps the source's mode: as any new file
            for written in tmp.iterdir():
                os.chmod(written, mode)
            _sync(tmp)
            for text in _publish(tmp, place, overwrite, in_place):
                note(text)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        temp.release()  # tmp is in place or deleted (or, killed, left for the next merge to finish or delete)
    return MergeResult(out, [out / f.name for f in ckpt.files], merged, notes=notes)


def _recorded_bundle(adapter: str | os.PathLike, meta: dict[str, Any]) -> str:
    """The bundle the adapter recorded; one that is no longer there is an error saying to pass its new place."""
    path = meta["bundle_path"]
    if not Path(path).exists():
        raise BundleError(
            f"{adapter}: the bundle this adapter was made with, {path}, is not there (moved or deleted?); pass its "
            "new place as bundle=DIR (CLI: --bundle)"
        )
    return path


def _files_to_copy(ckpt: Checkpoint, source: Path) -> list[Path]:
    """The small files beside the weights that make ``out`` a complete model directory (config, generation config,
    tokenizer, chat template, remote code). For a single ``.safetensors`` file, its directory's files only when
    that directory is the model's own (no other safetensors file, no index); else config.json alone."""
    own_dir = not source.is_file() or (
        [p.name for p in ckpt.root.glob("*.safetensors")] == [source.name] and not (ckpt.root / INDEX_FILE).exists()
    )
    return sorted(
        f
        for f in ckpt.root.iterdir()
        if f.is_file() and (f.suffix in _COPY_SUFFIXES if own_dir else f.name == "config.json")
    )


@contextlib.contextmanager
def _write_errors(out: Path) -> Iterator[None]:
    """An OSError or SafetensorError while writing ``out`` (disk full, read-only) as a one-line CheckpointError."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        if isinstance(e, OSError):
            reason = os_error_reason(out, e)
        else:
            reason = "disk full" if "No space left" in str(e) else str(e)
        todo = "free space or choose another --out" if reason == "disk full" else "choose another --out"
        raise CheckpointError(f"{out}: cannot write the merged checkpoint ({reason}); {todo}") from None


def _sync(directory: Path, files: bool = True) -> None:
    """fsync the files in ``directory`` (``files``) and the directory itself: after a crash (power loss) a merged
    checkpoint that was renamed into place holds its full shards, not empty or truncated files under final names."""
    if files:
        for f in directory.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory fds
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, out: Path, overwrite: bool, in_place: str | None = None) -> list[str]:
    """Put the finished, fsynced checkpoint in ``tmp`` at ``out``; returns notes for the user.

    A new ``out`` is ``tmp`` renamed. An existing one is replaced as a whole, so that no crash leaves a mix of old
    and new shards: its other entries (an adapter, a README, subdirectories: everything but the old checkpoint's
    weight files, see :func:`_stale_checkpoint_files`, and the files the merge writes) are hard-linked into ``tmp``
    (no data copied), ``tmp`` is renamed ``.OUT.swap-X`` and exchanged with ``out`` in one atomic step (Linux
    renameat2 RENAME_EXCHANGE), then the old checkpoint, now at ``.OUT.swap-X``, is deleted. Without an atomic
    exchange: ``out`` is renamed ``.OUT.swap-X`` and ``.OUT.partial-X`` renamed ``out``; a crash between the two
    leaves no ``out`` for a moment, which :func:`finish_interrupted_merge` completes. Where links cannot be made
    (a filesystem without hard links, a mount point inside ``out``) or ``out`` cannot be swapped (``in_place``, the
    reason: ``tmp`` is inside ``out``), the files are moved in one by one, with a note saying so.
    """
    if not out.exists():
        os.replace(tmp, out)
        _sync(out.parent, files=False)
        return []
    new = {f.name for f in tmp.iterdir()}
    why = in_place
    if why is None:
        stale = {p.name for p in _stale_checkpoint_files(out, new)} if overwrite else set()
        try:
            _link_entries(out, tmp, skip=new | stale)
            _copy_dir_attributes(out, tmp)
            _sync(tmp, files=False)
        except OSError as e:
            for entry in tmp.iterdir():
                if entry.name not in new:
                    _remove(entry)
            why = f"its other files could not be linked into the new checkpoint ({os_error_reason(out, e)})"
    if why is not None:
        _move_into_place(tmp, out, overwrite)
        _sync(out, files=False)
        return [
            f"{why}: the merged files were moved into {out} one by one, so a crash in between would have left a mix "
            "of old and new shards (plate-inspect verify finds them by fingerprint)"
        ]
    swap = tmp.with_name(_swap_name(tmp))
    os.replace(tmp, swap)  # from here on, the next merge into out deletes it if out is still there (rollback)
    try:
        exchanged = _exchange(swap, out)
    except BaseException:
        shutil.rmtree(swap, ignore_errors=True)  # out is still the old checkpoint
        raise
    if not exchanged:
        os.replace(swap, tmp)
        os.replace(out, swap)  # out is missing until the next line: finish_interrupted_merge completes it
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(swap, out)
            raise
    _sync(out.parent, files=False)
    shutil.rmtree(swap, ignore_errors=True)  # the old checkpoint; a leftover is deleted by the next merge into out
    return []


def finish_interrupted_merge(out: str | os.PathLike) -> list[str]:
    """Complete or clear what merges into ``out`` that were killed left beside it, and say what was done.

    Each merge holds the lock of its temporary directory ``.OUT.partial-X`` (``atomic.make_temp_dir``) until it is in
    place or deleted, also while it is renamed ``.OUT.swap-X`` to be swapped in (:func:`_publish`).
    Only directories whose lock this call can take (their merge died: the kernel drops a dead process's locks) are
    touched, each while holding that lock, so a merge running now and another cleanup never lose theirs:

    - ``out`` missing with ``.OUT.swap-X`` (the old checkpoint) and ``.OUT.partial-X`` (the finished new one): the
      new one is renamed ``out`` (rolled forward; without its partner the swap directory is put back);
    - with ``out`` in place, a ``.OUT.swap-X`` holds the old checkpoint or a new one never exchanged in (``out``
      stayed the old one: rolled back): deleted;
    - a ``.OUT.partial-X`` (beside ``out``, or inside it where the merge filled it in place) of a killed merge,
      incomplete or never swapped in: deleted; the note says how much space that freed (hard links to ``out``'s
      own files, made while swapping, free nothing and are not counted; ``out``'s files are never touched).

    A directory whose lock a running merge holds is left alone, with a note. One without a lock file (made by an
    older version, or on a filesystem without flock, where nothing tells whether its merge still runs) is named
    and never deleted (swap directories are deleted as before: they are only made after writing finished).
    """
    with _write_errors(path_argument(out, "out")):
        return _finish_interrupted_merge(out)


def _finish_interrupted_merge(out: str | os.PathLike) -> list[str]:
    place = _real_place(Path(out))
    try:
        swaps = _temp_dirs(place.parent, place.name, "swap")
    except OSError:
        return []
    notes = []
    with contextlib.ExitStack() as held:  # the swaps' locks, held until they are moved or deleted
        claims = {swap: held.enter_context(claim_temp_dir(_partial_name(swap))) for swap in swaps}
        live = [swap for swap in swaps if claims[swap] is Claim.LIVE]  # a merge swapping its checkpoint in now
        swaps = [swap for swap in swaps if swap not in live]
        if swaps and not live and not os.path.lexists(place):
            partial = _partial_name(swaps[0])
            if _plain_dir(partial):
                os.replace(partial, place)
                notes.append(
                    f"{out}: finished an interrupted merge into it (its complete new checkpoint moved into place)"
                )
            else:
                os.replace(swaps[0], place)
                notes.append(f"{out}: restored it from {swaps[0].name}, left by an interrupted merge into it")
                swaps = swaps[1:]
            _sync(place.parent, files=False)
        for swap in swaps if os.path.lexists(place) else []:
            shutil.rmtree(swap)
            notes.append(f"{out}: deleted {swap.name}, the checkpoint an interrupted merge into it swapped out")
    return notes + _clear_partials(out, place, live)


def _clear_partials(out: str | os.PathLike, place: Path, live: list[Path]) -> list[str]:
    """Delete the temporary directories of killed merges into ``place`` (their lock is free), name the others
    (``live``: the swap directories of running merges, already found)."""
    homes = [place.parent] + ([place] if _plain_dir(place) else [])  # inside OUT where the merge filled it in place
    removed: list[Path] = []
    unknown: list[Path] = []
    notes: list[str] = []
    freed = 0
    for home in homes:
        try:
            partials = _temp_dirs(home, place.name, "partial")
            locks = _temp_dirs(home, place.name, "partial", lock=True)
        except OSError:
            continue
        for partial in partials:
            with claim_temp_dir(partial) as claim:
                if claim is Claim.LIVE:
                    live.append(partial)
                elif claim is Claim.UNKNOWN:
                    unknown.append(partial)
                elif _plain_dir(partial):  # (a claimant before this one may have deleted it)
                    size = _own_bytes(partial)
                    try:
                        shutil.rmtree(partial)
                    except OSError as e:
                        why = e.strerror or e
                        notes.append(f"{out}: could not delete {partial}, left by a killed merge into it ({why})")
                    else:
                        removed.append(partial)
                        freed += size
        for directory in locks:  # lock files whose merge died before making its directory, or after moving it
            if not os.path.lexists(directory) and not os.path.lexists(directory.with_name(_swap_name(directory))):
                with claim_temp_dir(directory):
                    pass  # a free lock of a missing directory is removed when the claim ends
    if removed:
        notes.append(
            f"{out}: removed {_counted_dirs(removed)} of killed merges into it, {human_bytes(freed)} freed "
            f"({_names(removed)})"
        )
    if live:
        notes.append(f"{out}: left {_counted_dirs(live)} alone ({_names(live)}): a merge into it is running now")
    if unknown:
        size = sum(_own_bytes(p, linked=True) for p in unknown)
        notes.append(
            f"{_counted_dirs(unknown)} of an interrupted merge into {out} ({human_bytes(size)}: {unknown[0]}"
            + (", ..." if len(unknown) > 1 else "")
            + "); delete them unless a merge into it is running now (made without a lock, by an older "
            "plate-inspect or on a filesystem without flock, so this merge cannot tell)"
        )
    return notes


def _temp_dirs(home: Path, name: str, kind: str, lock: bool = False) -> list[Path]:
    """The directories ``.<name>.<kind>-X`` in ``home`` with make_temp_dir's X (12 hex digits), no symlinks; with
    ``lock``, the directories named by the lock files ``.<name>.<kind>-X.lock`` there (existing or not)."""
    prefix, suffix = f".{name}.{kind}-", ".lock" if lock else ""
    found = []
    for p in home.iterdir():
        x = p.name[len(prefix) : len(p.name) - len(suffix)]
        if p.name.startswith(prefix) and p.name.endswith(suffix) and re.fullmatch(r"[0-9a-f]{12}", x):
            found.append(p.with_name(prefix + x) if lock else p)
    return sorted(found if lock else filter(_plain_dir, found))


def _own_bytes(directory: Path, linked: bool = False) -> int:
    """The bytes of the files under ``directory`` (symlinks not followed); without ``linked``, only of files with
    no other hard link, the space deleting it frees (a killed swap's links to OUT's own files free nothing)."""
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, f))
                if stat.S_ISREG(st.st_mode) and (linked or st.st_nlink == 1):
                    total += st.st_size
    return total


def _counted_dirs(dirs: list[Path]) -> str:
    return counted(len(dirs), "temporary directory", "temporary directories")


def _names(dirs: list[Path]) -> str:
    return ", ".join(str(d) for d in dirs[:3]) + (", ..." if len(dirs) > 3 else "")


def _partial_name(swap: Path) -> Path:
    """``.OUT.partial-X`` for the swap directory ``.OUT.swap-X``: the name its lock file is made for."""
    head, _, suffix = swap.name.rpartition(".swap-")
    return swap.with_name(f"{head}.partial-{suffix}")


def _swap_name(tmp: Path) -> str:
    """``.OUT.swap-X`` for the temp dir ``.OUT.partial-X`` (make_temp_dir's name)."""
    head, _, suffix = tmp.name.rpartition(".partial-")
    return f"{head}.swap-{suffix}"


def _plain_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _real_place(out: Path) -> Path:
    """Where ``out``'s entries live, as an absolute path whose parent is the directory holding it: an existing
    directory resolved (a symlink ``out`` is not renamed over, the directory it points to is swapped; ``.`` has a
    parent), else ``out`` made absolute."""
    return Path(os.path.realpath(out)) if out.is_dir() else Path(os.path.abspath(out))


def _no_swap_reason(place: Path) -> str | None:
    """Why the existing directory ``place`` cannot be replaced as a whole, or None: a mount point cannot be renamed,
    and swapping the current directory (or one holding it) would leave this process, and the shell that started
    it, in the deleted old directory."""
    if not place.is_dir():
        return None
    if _is_mount_point(place):
        return f"{place} is a mount point (its parent is on another filesystem), so it cannot be swapped as a whole"
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except OSError:  # the current directory was deleted
        return None
    if cwd == place or place in cwd.parents:
        return (
            f"{place} is the current directory or holds it, and swapping it as a whole would leave the shell in the "
            "deleted old directory"
        )
    return None


def _is_mount_point(path: Path) -> bool:
    """True when ``path`` is on another filesystem than its parent (it cannot be renamed within the parent)."""
    try:
        return os.stat(path).st_dev != os.stat(path.resolve().parent).st_dev
    except OSError:
        return False


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False
    where the platform, libc or filesystem has no such call (the caller then renames twice)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _link_entries(src: Path, dst: Path, skip: set[str] | frozenset[str] = frozenset()) -> None:
    """Mirror ``src``'s entries but ``skip`` into ``dst`` without copying data: files as hard links (same inode:
    same bytes, mode, owner), symlinks as symlinks, directories as new directories of links. OSError where that
    cannot be done: no hard links on this filesystem, a mount point inside, a device file or FIFO."""
    device = os.stat(src).st_dev
    for entry in sorted(src.iterdir()):
        if entry.name in skip:
            continue
        target = dst / entry.name
        st = entry.lstat()
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(entry), target)
        elif stat.S_ISREG(st.st_mode):
            os.link(entry, target, follow_symlinks=False)
        elif stat.S_ISDIR(st.st_mode) and st.st_dev == device:
            os.mkdir(target)
            _link_entries(entry, target)
            _copy_dir_attributes(entry, target)
            _sync(target, files=False)
        else:
            what = "a mount point" if stat.S_ISDIR(st.st_mode) else "not a file, directory or symlink"
            raise OSError(errno.EXDEV if stat.S_ISDIR(st.st_mode) else errno.ENOTSUP, what, str(entry))


def _copy_dir_attributes(src: Path, dst: Path) -> None:
    """The mode, times and (where permitted) owner of directory ``src`` on ``dst``, which takes its place."""
    shutil.copystat(src, dst, follow_symlinks=False)
    st = os.stat(src)
    with contextlib.suppress(OSError):
        if (st.st_uid, st.st_gid) != (os.stat(dst).st_uid, os.stat(dst).st_gid):
            os.chown(dst, st.st_uid, st.st_gid)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished files into an existing ``out`` one by one (not crash-safe: :func:`_publish`'s fallback).

    With ``overwrite``, the files of the checkpoint already there that the new one does not write are removed (see
    :func:`_stale_checkpoint_files`); other files (an adapter kept there, a bundle directory) are left alone.
    """
    new = {f.name for f in tmp.iterdir()}
    if overwrite:
        for stale in _stale_checkpoint_files(out, new):
            stale.unlink()
    for name in sorted(new):
        os.replace(tmp / name, out / name)
    tmp.rmdir()


def _stale_checkpoint_files(out: Path, new: set[str]) -> list[Path]:
    """The files of the checkpoint in ``out`` that a merge writing the file names ``new`` leaves stale: its index
    (a single-file merge over a sharded one would keep an index naming deleted shards) and the shards that index
    names, and save_pretrained's weight files (``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``).
    Any other safetensors file (an adapter, say) is not the checkpoint's and is kept."""
    names = {f.name for f in out.iterdir() if f.is_file() and _WEIGHT_FILE.fullmatch(f.name)}
    index = out / INDEX_FILE
    if index.is_file():
        names.add(INDEX_FILE)
        with contextlib.suppress(OSError, ValueError, KeyError, AttributeError, TypeError):
            names |= {Path(v).name for v in json.loads(index.read_text())["weight_map"].values()}
    return [out / n for n in sorted(names - new) if (out / n).is_file()]


def _stored_dtype(dtype: str) -> torch.dtype:
    """The torch dtype a tensor copied unchanged into the merged checkpoint is rebuilt in (its stored one)."""
    dt = torch_dtype(dtype)
    if dt is None:
        raise CheckpointError(f"cannot rewrite a tensor stored as {dtype}")
    return dt


def _header_metadata(file: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, to carry over to the rewritten file."""
    from plate_inspect.checkpoint import parse_safetensors_header

    _, meta = parse_safetensors_header(file)
    return {str(k): str(v) for k, v in meta.items()}


def check_rescan_out(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse a rescan target that already holds a bundle (unless ``overwrite``) or is a file: checked before the
    merge writes anything, so a refused rescan leaves no merged checkpoint behind either."""
    from plate_inspect.scanner import check_out_dir

    out = path_argument(out, "bundle_out (CLI: --rescan)")
    bool_argument(overwrite, "overwrite")
    if out.exists() and not out.is_dir():
        raise BundleError(f"{out}: exists and is not a directory; choose another --rescan directory")
    check_out_dir(out, option="--rescan")  # a file in the way, not writable: refused before the merge writes
    if (out / MANIFEST).exists() and not overwrite:
        raise BundleError(
            f"{out}: already holds a bundle; pass overwrite=True (CLI: --overwrite) to replace it, "
            "or choose another --rescan directory"
        )
    return out


def split_scan_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``overrides`` split into :class:`ScanSettings` fields and :func:`run_scan` keywords; ConfigError naming any
    other keyword and listing the allowed ones (a misspelt ``tua=0.5`` failed inside run_scan as a TypeError, and in
    :func:`sequential_step` only after the merged checkpoint was written)."""
    import inspect

    from plate_inspect.scanner import run_scan

    settings = list(ScanSettings.__dataclass_fields__)
    run = [p.name for p in inspect.signature(run_scan).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = [k for k in overrides if k not in settings and k not in run]
    if unknown:
        close = difflib.get_close_matches(unknown[0], settings + run, n=1)
        raise ConfigError(
            f"unknown scan setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; the rescan takes ScanSettings fields ({', '.join(settings)}) and run_scan's {', '.join(run)}"
        )
    fields = {k: v for k, v in overrides.items() if k in settings}
    return fields, {k: v for k, v in overrides.items() if k not in fields}


def rescan_plan(
    model: str | os.PathLike, previous: Bundle | str | os.PathLike, overrides: dict[str, Any]
) -> tuple[ScanPlan, dict[str, Any]]:
    """The rescan's plan of ``model`` (the previous bundle's settings, ``overrides`` winning) and its
    :func:`run_scan` keywords, each value checked by the function the scan itself checks it with: the
    :class:`ScanSettings` constructor, :func:`plan_scan` (target modules, layers, sketch dim against the weights; the
    source checkpoint has the merged one's names and shapes, so its plan checks them before a merge), and run_scan's
    device, devices, expert_group and progress rules. So :func:`sequential_step`
    refuses ``tau=5`` or ``device='tpu'`` before the merge writes (they failed after the merged checkpoint was
    written). An old-style ``progress`` comes back adapted (its deprecation warning is given once)."""
    import dataclasses

    from plate_inspect.progress import as_callback
    from plate_inspect.scanner import check_run_arguments, plan_scan

    fields, run = split_scan_overrides(overrides)
    prev = previous if isinstance(previous, Bundle) else Bundle.load(previous)
    plan = plan_scan(model, dataclasses.replace(prev.settings, **fields))
    if "overwrite" in run:
        bool_argument(run["overwrite"], "overwrite")
    if "progress" in run:
        run["progress"] = as_callback(run["progress"], "rescan")
    check_run_arguments(run.get("device", "cpu"), run.get("devices"), run.get("expert_group"))
    return plan, run


def rescan(
    merged: str | os.PathLike, previous: Bundle | str | os.PathLike, out: str | os.PathLike, **overrides: Any
) -> Bundle:
    """Scan the merged checkpoint with the scanner, using the previous bundle's settings (``overrides`` win: any
    :class:`ScanSettings` field, or a keyword of :func:`run_scan`: ``overwrite``, ``device``, ``devices``,
    ``progress``, ``expert_group``; anything else is a ConfigError). Every value is checked before the scan writes
    (:func:`rescan_plan`)."""
    from plate_inspect.scanner import run_scan

    path_argument(merged, "merged")
    path_argument(out, "out")
    if not isinstance(previous, Bundle):
        path_argument(previous, "previous")
    plan, run = rescan_plan(merged, previous, overrides)
    return run_scan(plan, out, **run)


def sequential_step(
    source: str | os.PathLike,
    adapter: str | os.PathLike,
    out: str | os.PathLike,
    bundle_out: str | os.PathLike | None = None,
    bundle: Bundle | str | os.PathLike | None = None,
    overwrite: bool = False,
    **scan_overrides: Any,
) -> MergeResult:
    """Merge the adapter into ``source``, write it to ``out``, rescan it into ``bundle_out`` (default out/bundle).

    A ``bundle_out`` that already holds a bundle is refused before anything is written, unless ``overwrite``;
    ``scan_overrides`` are :func:`rescan`'s: an unknown one, or a bad value of any scan setting (``tau=5``,
    ``device='tpu'``, target modules the model lacks), is refused before anything is written too."""
    from plate_inspect.scanner import plan_scan, run_scan

    path_argument(out, "out")
    path_argument(adapter, "adapter")
    split_scan_overrides(scan_overrides)
    bundle_out = check_rescan_out(bundle_out or Path(out) / "bundle", overwrite)
    _, meta = read_adapter(adapter)
    prev = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle or _recorded_bundle(adapter, meta))
    checked, run = rescan_plan(source, prev, {**scan_overrides, "overwrite": overwrite})  # before the merge writes
    result = merge_checkpoint(source, adapter, out, bundle=prev, overwrite=overwrite)
    result.bundle = run_scan(plan_scan(result.out, checked.settings), bundle_out, **run)
    return result
