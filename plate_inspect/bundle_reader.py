"""A bundle on disk, read: :class:`Bundle` opens the manifest, reads each module's tensors on demand, and says what
is wrong with a missing, damaged or mixed-up part file (one line, with the mend).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from plate_inspect.arguments import path_argument
from plate_inspect.bundle import (
    MANIFEST,
    MANIFEST_MEND,
    STATS,
    TENSOR_KINDS,
    Manifest,
    ModuleRecord,
    ScanSettings,
    geometry_digest,
    unfinished_note,
)
from plate_inspect.bundle_parts import finished_modules, foreign_safetensors
from plate_inspect.errors import BundleError, ConfigError, PlateInspectError, os_error_text
from plate_inspect.formatting import counted
from plate_inspect.safetensors_header import parse_safetensors_header

__all__ = ["Bundle", "ModulePlate", "not_a_bundle", "read_problem", "stored_b_problem"]


def not_a_bundle(path: Path) -> str:
    """Why ``path`` (no manifest there) is not a bundle, and a command that makes one there or from it that would
    itself work: a model checkpoint's directory or file cannot be a scan's --out, so it is named as the MODEL."""
    command = f"plate-inspect scan MODEL --out {shlex.quote(str(path))}"
    if path.is_dir():
        model_files = [f.name for f in foreign_safetensors(path)]
        model_files += ["config.json"] if (path / "config.json").is_file() else []
        if not model_files:
            return f"{path}: not a bundle (no {MANIFEST}); create a bundle with: {command}"
        shown = ", ".join(model_files[:3]) + (", ..." if len(model_files) > 3 else "")
        return (
            f"{path}: not a bundle (no {MANIFEST}) but, by its files ({shown}), a model checkpoint; create a bundle of "
            f"it with: plate-inspect scan {shlex.quote(str(path))} --out <another directory>"
        )
    if not path.exists():
        return f"{path}: does not exist; create a bundle with: {command}"
    if (path.parent / MANIFEST).is_file():
        return f"{path}: is a part file of the bundle {path.parent}; give the bundle directory: {path.parent}"
    if path.suffix == ".safetensors":
        try:
            parse_safetensors_header(path)
        except PlateInspectError as e:  # not a model either: say what it is, not to scan it
            why = str(e).removeprefix(f"{path}: ")
            return f"{path}: is a file, not a bundle directory, and no readable safetensors file: {why}"
        return (
            f"{path}: is a file, not a bundle directory; to make a bundle of a model checkpoint in it: "
            f"plate-inspect scan {shlex.quote(str(path))} --out <a directory>"
        )
    return (
        f"{path}: is a file, not a bundle directory; create a bundle with: plate-inspect scan MODEL --out <a directory>"
    )


@dataclass
class ModulePlate:
    """B and Q of one module, ready for a trainer."""

    record: ModuleRecord
    b_idx: torch.Tensor  # int64 [r]
    q: torch.Tensor  # [d_in, k]

    def __repr__(self) -> str:
        """One line: the module, B's count and Q's dtype and shape (the dataclass repr printed both tensors)."""
        q_dtype = str(self.q.dtype).removeprefix("torch.")
        return f"ModulePlate({self.record.name!r}, b_idx={self.b_idx.numel()} rows, q={q_dtype} {list(self.q.shape)})"


def read_problem(error: Exception, what: str) -> str:
    """What reading ``what`` from a part file met: the file is missing, or safetensors could not read it."""
    if isinstance(error, FileNotFoundError):
        return "part file missing"
    return f"cannot read '{what}' (the part file is damaged: {error})"


def stored_b_problem(rec: ModuleRecord, b_idx: torch.Tensor) -> str:
    """'' when stored B indices are what a scan writes (r of them, in [0, d_out), strictly ascending), else what is
    wrong: a damaged part file, whose indices would otherwise be used (or crash an index)."""
    if b_idx.ndim != 1 or b_idx.numel() != rec.r:
        return f"B holds {b_idx.numel()} indices, the manifest says r={rec.r}"
    if b_idx.numel() and (int(b_idx.min()) < 0 or int(b_idx.max()) >= rec.d_out):
        return f"B indices out of range [0, {rec.d_out})"
    if b_idx.numel() > 1 and not bool((b_idx[1:] > b_idx[:-1]).all()):
        return "B indices not strictly ascending"
    return ""


def _modules_phrase(records: list[ModuleRecord], named: bool = True) -> str:
    """ "layer 1's 7 modules (model.layers.1.mlp.down_proj, ...)": how many, of which layers, the first one named."""
    layers = sorted({rec.layer for rec in records if rec.layer is not None})
    of = f"layer {', '.join(map(str, layers))}'s " if layers else ""
    first = f" ({records[0].name}{', ...' if len(records) > 1 else ''})" if named else ""
    return f"{of}{counted(len(records), 'module')}{first}"


#: How many part files a :class:`Bundle` keeps open between tensor reads (modules are read layer by layer).
OPEN_PARTS = 4


class Bundle:
    """A PLATE init bundle on disk: the manifest in memory, tensors read on demand."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._mixed_up: dict[str, str] = {}  # part file -> what it holds instead of its modules (read failures only)
        self._by_file: tuple[dict[str, ModuleRecord], dict[str, list[ModuleRecord]]] | None = None
        # part file -> (its stat signature, an open safe_open handle): opening a part parses its whole header (9 ms
        # for a 776-module MoE layer), so reading every module's tensors through fresh opens dominated plan/verify
        self._open_parts: dict[str, tuple[tuple[int, int, int], Any]] = {}

    @classmethod
    def load(cls, path: str | os.PathLike, require_complete: bool = True) -> Bundle:
        """Open the bundle in directory ``path``: its manifest is read and checked; tensors are read on demand.

        Args:
            path: a directory written by :func:`plate_inspect.scan`.
            require_complete: refuse an unfinished scan's bundle (False: open it with the modules finished so far).

        Raises a :class:`BundleError` saying what to do when ``path`` is no bundle, or an unfinished or damaged one.
        """
        path = path_argument(path, "path")
        mpath = path / MANIFEST
        if not mpath.exists():
            raise BundleError(not_a_bundle(path))
        try:
            data = json.loads(mpath.read_text())
        except PermissionError as e:  # not damaged: this user may not read it, and a rescan would not help
            raise BundleError(os_error_text(e) or str(e)) from None
        except (OSError, ValueError, RecursionError) as e:  # ValueError: invalid JSON or UTF-8
            raise BundleError(f"{mpath}: unreadable manifest ({e}); {MANIFEST_MEND}") from None
        manifest = Manifest.from_json(data, mpath)
        if not manifest.complete:  # the finished modules of an unfinished scan are recorded in the part headers
            manifest.modules = finished_modules(path, manifest)
        if require_complete and not manifest.complete:
            raise BundleError(f"{path}: {unfinished_note(manifest)}")
        return cls(path, manifest)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle / deepcopy without the open part-file handles (they reopen on the next read)."""
        return {**self.__dict__, "_open_parts": {}}

    # ----------------------------------------------------------------- access
    @property
    def settings(self) -> ScanSettings:
        """The settings the bundle was scanned with."""
        return self.manifest.settings

    @property
    def modules(self) -> list[str]:
        """The names of the modules the bundle holds geometry for, in scan order."""
        return list(self.manifest.modules)

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.modules

    def __len__(self) -> int:
        return len(self.manifest.modules)

    def __iter__(self) -> Iterator[ModuleRecord]:
        return iter(self.manifest.modules.values())

    def __repr__(self) -> str:
        m, s = self.manifest, self.manifest.settings
        state = "complete" if m.complete else f"unfinished, {len(m.modules)} of {len(m.planned)} modules"
        return (
            f"Bundle({str(self.path)!r}, model={m.source.get('id')!r}, modules={len(m.modules)}, r={s.r}, "
            f"tau={s.tau}, max_rank={s.max_rank}, {state})"
        )

    def record(self, name: str) -> ModuleRecord:
        """The manifest record of module ``name`` (shape, r, k, fingerprint, ...); BundleError if there is none."""
        if not isinstance(name, str):
            raise ConfigError(f"name must be a module name (str), got {name!r:.80}")
        try:
            return self.manifest.modules[name]
        except KeyError:
            raise BundleError(f"{self.path}: no module '{name}' in this bundle{self._closest(name)}") from None

    def _closest(self, name: str) -> str:
        """'; did you mean ...' for a weight name (``.weight``) or a near miss of a module name, else ''."""
        stem = name.removesuffix(".weight")
        if stem != name and stem in self.manifest.modules:
            return f" (module names have no '.weight'); did you mean '{stem}'?"
        # a near miss in spelling at the same layer/expert numbers, never another layer's module
        numbers = re.findall(r"\d+", name)
        close = [
            c
            for c in difflib.get_close_matches(name, self.manifest.modules, n=5, cutoff=0.8)
            if re.findall(r"\d+", c) == numbers
        ]
        return f"; did you mean '{close[0]}'?" if close else f" (it has {len(self.manifest.modules)}: see .modules)"

    def tensor(self, name: str, kind: str) -> torch.Tensor:
        """One stored tensor of module ``name``: ``kind`` is one of :data:`TENSOR_KINDS`."""
        if kind not in TENSOR_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(TENSOR_KINDS)}, got {kind!r:.80}")
        rec = self.record(name)
        part = self.path / rec.file
        key = f"{name}.{kind}"
        try:
            return self._part_handle(rec.file, part).get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt files / missing keys
            self._close_part(rec.file)
            mixed = "" if isinstance(e, FileNotFoundError) else self._part_mixed_up(rec.file)
            raise self.damaged(name, f"the part file {mixed}" if mixed else read_problem(e, key)) from None

    def _part_handle(self, file: str, part: Path) -> Any:
        """An open handle on part file ``file``, kept for the next read while the file on disk is the same one.

        The stat signature (inode, size, mtime) is checked on every call: a rescan replaces part files by rename, and
        a handle on the replaced file would read the old weights' geometry. At most :data:`OPEN_PARTS` stay open.
        """
        st = os.stat(part)
        signature = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._open_parts.pop(file, None)
        if cached is not None and cached[0] == signature:
            self._open_parts[file] = cached  # most recently used last
            return cached[1]
        if cached is not None:
            cached[1].__exit__(None, None, None)
        handle = safe_open(str(part), framework="pt").__enter__()
        self._open_parts[file] = (signature, handle)
        while len(self._open_parts) > max(OPEN_PARTS, 1):
            self._close_part(next(iter(self._open_parts)))
        return handle

    def _close_part(self, file: str) -> None:
        """Close the kept handle on part file ``file``, if there is one."""
        cached = self._open_parts.pop(file, None)
        if cached is not None:
            cached[1].__exit__(None, None, None)

    def _part_mixed_up(self, file: str) -> str:
        """:meth:`mixed_up` of a part file whose tensor could not be read ('' if its header cannot be read either);
        once per file (verify reads every module of a swapped part)."""
        if file not in self._mixed_up:
            try:
                entries, _ = parse_safetensors_header(self.path / file)
                self._mixed_up[file] = self.mixed_up(file, entries)
            except PlateInspectError:
                self._mixed_up[file] = ""
        return self._mixed_up[file]

    def _records_by_file(self) -> dict[str, list[ModuleRecord]]:
        """The manifest's records grouped by part file (each list in manifest order), built once: checking every part
        file (:meth:`damaged_parts`) would otherwise scan all records per file, files x modules (a DeepSeek-V3 bundle:
        1,037 parts x 47k modules). Rebuilt if the manifest's module table is replaced."""
        modules = self.manifest.modules
        if self._by_file is None or self._by_file[0] is not modules:
            grouped: dict[str, list[ModuleRecord]] = {}
            for rec in modules.values():
                grouped.setdefault(rec.file, []).append(rec)
            self._by_file = (modules, grouped)
        return self._by_file[1]

    def mixed_up(self, file: str, keys: Iterable[str]) -> str:
        """'' when part file ``file`` (tensor names ``keys``) holds every tensor of the modules the manifest puts in
        it; else what it holds instead: another part's modules (part files renamed or swapped by hand), or too few.

        Said once with the modules named, where a read would say only that one tensor is not in the file."""
        keys = set(keys)
        mine = self._records_by_file().get(file, [])
        lacking = [rec for rec in mine if any(f"{rec.name}.{kind}" not in keys for kind in TENSOR_KINDS)]
        if not lacking:
            return ""
        held = {key.rsplit(".", 1)[0] for key in keys}
        others = [rec for rec in self if rec.name in held and rec.file != file]
        if not others:
            return f"lacks the tensors of {_modules_phrase(lacking)} that the manifest puts in it"
        own = _modules_phrase(mine, named=False)
        own = own if own.startswith("layer") else f"the {own}"
        return (
            f"holds {_modules_phrase(others)}, not {own} the manifest puts in it "
            f"(part files renamed or swapped by hand; the manifest puts those in {others[0].file})"
        )

    def damaged(self, name: str, problem: str) -> BundleError:
        """The one-line error for a module whose part file is missing, unreadable or holds damaged tensors: the file,
        the module, what is wrong, and the mend (the scan that made the bundle, rerun into it, recomputes it)."""
        return BundleError(
            f"{self.path / self.record(name).file}: module '{name}': {problem}; rerun the scan that made this bundle "
            f"(same model and settings) into {self.path}: missing or damaged part files are recomputed, the others "
            f"kept (plate-inspect verify {shlex.quote(str(self.path))} lists the damage)"
        )

    def damaged_parts(self) -> dict[str, str]:
        """{part file: what is wrong} for the part files the manifest names that are missing, unreadable or truncated.

        Reads each file's header only (its size checked against the tensors it describes), not the tensors: a cheap
        check for commands that show the manifest alone (info, health); ``verify`` checks every tensor.
        """
        problems = {}
        for file in sorted(self._records_by_file()):
            path = self.path / file
            if not path.is_file():
                problems[file] = "missing"
                continue
            try:
                entries, _ = parse_safetensors_header(path)
            except PlateInspectError as e:
                problems[file] = str(e).removeprefix(f"{path}: ").split("; ")[0]  # the reader's mend is for models
                continue
            mixed = self.mixed_up(file, entries)
            if mixed:
                problems[file] = mixed
        return problems

    def check_parts(self) -> None:
        """BundleError naming the missing or damaged part files (:meth:`damaged_parts`) and the mend; else nothing."""
        problems = self.damaged_parts()
        if not problems:
            return
        named = ", ".join(f"{file} ({problem})" for file, problem in list(problems.items())[:3])
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        n_parts = len(self._records_by_file())
        raise BundleError(
            f"{self.path}: {len(problems)} of {n_parts} part files missing or damaged: {named}{more}; rerun the scan "
            f"that made this bundle (same model and settings) into {self.path}: missing or damaged part files are "
            f"recomputed, the others kept (plate-inspect verify {shlex.quote(str(self.path))} lists the modules)"
        )

    def checked_b_idx(self, name: str, with_digest: bool = False) -> torch.Tensor:
        """A module's stored B indices, refused (``damaged``) when they are not what a scan writes, or (``with_digest``:
        Q is read too) not the B and Q the scan recorded."""
        rec = self.record(name)
        b_idx = self.b_idx(name)
        problem = stored_b_problem(rec, b_idx)
        recorded = with_digest and not problem and rec.geometry_digest
        if recorded and geometry_digest(b_idx, self.q(name, dtype=None)) != rec.geometry_digest:
            problem = "its B or Q do not match the digest the scan recorded"
        if problem:
            raise self.damaged(name, problem)
        return b_idx

    def b_idx(self, name: str) -> torch.Tensor:
        """B: the output rows [r] of module ``name`` that PLATE updates (int64, ascending; the r most redundant)."""
        return self.tensor(name, "plate_B_idx")

    def q(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Q: module ``name``'s orthonormal low-energy input basis [d_in, k] (the bottom-k eigenvectors of W_f^T W_f,
        ascending energy), in ``dtype`` (None: as stored, ``settings.q_dtype``)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"dtype must be a torch floating dtype (e.g. torch.float32) or None, got {dtype!r:.80}")
        q = self.tensor(name, "plate_Q")
        return q.to(dtype) if dtype is not None else q

    def redundancy(self, name: str) -> torch.Tensor:
        """The redundancy score of each of module ``name``'s d_out rows (B holds the r highest)."""
        return self.tensor(name, "redundancy")

    def spectrum(self, name: str) -> torch.Tensor:
        """The eigenvalues of W_f^T W_f of module ``name`` (W without B's rows), descending: [min(d_out - r, d_in)]."""
        return self.tensor(name, "spectrum")

    def plate(self, name: str, dtype: torch.dtype | None = torch.float32) -> ModulePlate:
        """Module ``name``'s record, B and Q (in ``dtype``, as :meth:`q`) together, as a trainer takes them."""
        return ModulePlate(self.record(name), self.b_idx(name), self.q(name, dtype))

    def stats(self) -> dict[str, Any]:
        """Run statistics of the scan that produced the bundle (wall time, bytes read, peak RSS), if recorded."""
        p = self.path / STATS
        try:
            return json.loads(p.read_text()) if p.exists() else {}
        except (OSError, json.JSONDecodeError):
            return {}
