"""Writing a bundle: :class:`BundleWriter` fills a directory that is new, resumable, or replaced with ``overwrite``,
part file by part file, and marks the manifest complete last.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from plate_inspect.atomic import atomic_write, stale_temps
from plate_inspect.bundle import (
    MANIFEST,
    SELECTION_SETTINGS,
    STATS,
    Manifest,
    ModuleRecord,
    ScanSettings,
    unfinished_state,
    weight_key,
    weight_key_json,
)
from plate_inspect.bundle_parts import (
    encode_part,
    finished_modules,
    intact_records,
    part_records,
    records_by_part,
    refuse_foreign_safetensors,
)
from plate_inspect.errors import BundleError, PlateInspectError, os_fault

__all__ = ["API_REPLACE_HINT", "REPLACE_HINT", "BundleWriter", "describe_variant", "rescan_baseline", "write_file"]

#: What to do about an output directory that holds another bundle, for Python and CLI users alike.
REPLACE_HINT = "replace it with overwrite=True (CLI: --overwrite), or write elsewhere (CLI: --out)"
#: The same for writers with no CLI command (``make_variant``): the Python keywords only.
API_REPLACE_HINT = "replace it with overwrite=True, or write elsewhere (another out)"


def rescan_baseline(
    path: Path, old: Manifest, parts: dict[str, dict[str, ModuleRecord]] | None = None
) -> tuple[dict[str, list], list[str]]:
    """What a rescan counts changes against, for a finished bundle ``old`` in ``path``: each module's weight key
    from its part file's header (what the scan checks the weights against to keep a module), from its manifest
    record where no part vouches for it; and the modules whose manifest record disagrees with their part header
    (an edited manifest: the rescan rewrites it from the part files). ``parts``: the headers' records
    (:func:`records_by_part`) when the caller read them already."""
    headers = finished_modules(path, old, parts)
    baseline, disagree = {}, []
    for name, rec in old.modules.items():
        header = headers.get(name)
        if header is not None and weight_key(header) != weight_key(rec):
            disagree.append(name)
        baseline[name] = weight_key_json(header or rec)
    return baseline, disagree


def describe_variant(variant: dict[str, Any] | None) -> str:
    """'a scanned bundle' or 'the random_q ablation (seed 1) of bundle sha256:0123abcd...'."""
    if not variant:
        return "a scanned bundle"
    base = str(variant.get("base_identity", ""))
    return f"the {variant.get('kind')} ablation (seed {variant.get('seed')}) of bundle {base[:15]}..."


def _io_error(path: Path, e: OSError) -> PlateInspectError:
    """An OSError of a bundle write in the bundle's words: out of space resumes, a place not writable is changed."""
    fault = os_fault(e)
    if fault.space:
        why = fault.reason or e.strerror
        return BundleError(f"{path}: {why} while writing the bundle; free space and rerun to resume")
    if fault.denied:
        return BundleError(f"{path}: output directory is not writable ({e.strerror}); choose another --out")
    return BundleError(f"{path}: cannot write ({e.strerror or e})")


def write_file(path: Path, data: bytes | str) -> None:
    """Atomic write of one bundle file, with the bundle's wording for I/O errors."""
    try:
        atomic_write(path, data)
    except OSError as e:
        raise _io_error(path, e) from None


class BundleWriter:
    """Writes a bundle part by part into a directory that is new, resumable, or replaced with ``overwrite``.

    :meth:`open` refuses a directory holding a bundle of other settings, other modules or another variant; it
    marks the manifest incomplete until :meth:`finalize`. Part files are written atomically and carry their own
    records, so whether an existing part can be kept is decided per module by :meth:`reusable`.
    """

    def __init__(
        self, path: str | os.PathLike, manifest: Manifest, overwrite: bool = False, cli_hints: bool = True
    ) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.overwrite = overwrite
        # refusals' hints name the keywords and, for writers the CLI runs (scan, merge --rescan), the flags too
        self._replace_hint = REPLACE_HINT if cli_hints else API_REPLACE_HINT
        self._overwrite_hint = "overwrite=True (CLI: --overwrite)" if cli_hints else "overwrite=True"
        self._elsewhere_hint = "write elsewhere (CLI: --out)" if cli_hints else "write elsewhere (another out)"
        self.damaged: list[str] = []  # modules whose stored tensors no longer matched their digests (recomputed)
        self.resumed = False  # the directory held an unfinished bundle of the same settings: this run finishes it
        self.manifest_disagrees: list[str] = []  # modules whose old manifest record disagreed with their part header
        self._lock: int | None = None
        # part file -> the records its header vouches for, read by open() for a rescan (same settings and variant as
        # this writer's: any other bundle is refused); each used once by reusable(), before the part is rewritten
        self._headers: dict[str, dict[str, ModuleRecord]] = {}

    def open(self) -> Manifest:
        """Check and prepare the directory (locked against a second writer until :meth:`close` or :meth:`finalize`);
        returns the (incomplete) manifest the scan fills in."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-probe-"):
                pass
        except OSError as e:
            raise _io_error(self.path, e) from None
        self._acquire_lock()
        try:
            return self._prepare()
        except BaseException:
            self.close()
            raise

    def _acquire_lock(self) -> None:
        """An exclusive advisory lock on the directory itself (flock: no lock file to go stale, released by the
        kernel when the process dies, even by SIGKILL). Two scans into one --out would mix their part files."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no locking
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BundleError(
                f"{self.path}: another scan is writing this bundle right now (the directory is locked); wait for it "
                f"to finish, or {self._elsewhere_hint}"
            ) from None
        except OSError:  # a filesystem without flock on directories (some network mounts): go on unlocked
            os.close(fd)
            return
        self._lock = fd

    def close(self) -> None:
        """Release the directory lock (also done by :meth:`finalize`, and by the kernel at process exit)."""
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor drops its flock
            self._lock = None

    def _prepare(self) -> Manifest:
        """Refuse another bundle (or clear it with ``overwrite``), then write this scan's incomplete manifest.

        A directory holding safetensors files that are not bundle parts (a model's weights: --out given as the
        checkpoint's own directory) is refused, with or without ``overwrite``: nothing of it is deleted.
        """
        existing = self.path / MANIFEST
        refuse_foreign_safetensors(self.path, f", even with {self._overwrite_hint}", self._elsewhere_hint)
        if existing.exists() and not self.overwrite:
            try:
                old = Manifest.from_json(json.loads(existing.read_text()), existing)
            except (ValueError, RecursionError, OSError, BundleError):  # ValueError: invalid JSON or UTF-8
                raise BundleError(
                    f"{self.path}: holds something that is not a matching bundle; {self._replace_hint}"
                ) from None
            self._refuse_other(old)
            self.resumed = not old.complete
            # a rescan remembers the finished bundle it updates, through any number of interruptions
            if old.complete:  # each part's header is read once: reusable() takes its records from here
                self._headers = records_by_part(self.path, old)
                self.manifest.baseline, self.manifest_disagrees = rescan_baseline(self.path, old, self._headers)
            else:
                self.manifest.baseline = old.baseline
        elif self.overwrite:  # only the bundle's own files (foreign ones were refused above)
            for p in list(self.path.glob("*.safetensors")) + [existing, self.path / STATS]:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        # a writer killed mid-write (SIGKILL) left its temp file; this one holds the directory's lock, so no other
        # writer of these names is running (a report written into the directory keeps its own temp file)
        for name_glob in ("*.safetensors", MANIFEST, STATS):
            for temp in stale_temps(self.path, name_glob):
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
        self.manifest.modules, self.manifest.complete, self.manifest.identity = {}, False, ""
        self._write_manifest()
        return self.manifest

    def _refuse_other(self, old: Manifest) -> None:
        """Refuse a directory whose bundle differs in anything but weights (weights changes are rescanned).

        Settings are compared as resolved: the selection settings (:data:`SELECTION_SETTINGS`) by the modules they
        plan, so an equivalent spelling is accepted; the scan then goes on with the bundle's own spelling of them
        (its part files, settings digest and identity stay valid: nothing is recomputed for the spelling).
        """

        def state() -> str:  # for a refusal only: an unfinished manifest records no modules, its part files do
            if old.complete:
                return "a finished"
            old.modules = finished_modules(self.path, old)
            return f"an unfinished ({unfinished_state(old)})"

        if old.variant != self.manifest.variant:
            raise BundleError(
                f"{self.path}: holds {state()} bundle that is {describe_variant(old.variant)}, not "
                f"{describe_variant(self.manifest.variant)}; {self._replace_hint}"
            )
        same_plan = old.planned == self.manifest.planned
        differ = [
            f.name
            for f in fields(ScanSettings)
            if getattr(old.settings, f.name) != getattr(self.manifest.settings, f.name)
            and (f.name not in SELECTION_SETTINGS or not same_plan)
        ]
        if differ:
            changed = [
                f"{n} {getattr(old.settings, n)!r} there, {getattr(self.manifest.settings, n)!r} here" for n in differ
            ]
            if not same_plan:
                changed.append(f"{len(old.planned)} modules there, {len(self.manifest.planned)} here")
            raise BundleError(
                f"{self.path}: holds {state()} bundle made with other settings ({'; '.join(changed)}); "
                f"{self._replace_hint}"
            )
        if not same_plan:
            raise BundleError(
                f"{self.path}: holds {state()} bundle of other target modules ({len(old.planned)} there, "
                f"{len(self.manifest.planned)} here); {self._replace_hint}"
            )
        if old.settings != self.manifest.settings:  # an equivalent spelling of the selection: keep the bundle's
            self.manifest.settings = old.settings
            self.manifest.selection_note = old.selection_note

    def reusable(self, part: str) -> dict[str, ModuleRecord]:
        """Records of an existing part file that were made with this bundle's settings and variant, and whose
        stored tensors still match their digests (a damaged module is recomputed, not kept)."""
        records = self._headers.pop(part, None)
        if records is None:
            records = part_records(self.path / part, self.manifest.settings, self.manifest.variant)
        intact = intact_records(self.path / part, records) if records else records
        self.damaged.extend(name for name in records if name not in intact)
        return intact

    def write_part(self, part: str, records: list[ModuleRecord], tensors: dict[str, torch.Tensor]) -> None:
        """Atomically write one part file (tensors + its records in the header) and keep its records."""
        data = encode_part(records, tensors, self.manifest.settings, self.manifest.variant)
        write_file(self.path / part, data)
        self.add_records(records)

    def add_records(self, records: Iterable[ModuleRecord]) -> None:
        """Records of modules whose part is written (by this process or, in a distributed scan, by another rank)."""
        for rec in records:
            self.manifest.modules[rec.name] = rec

    def finalize(self, stats: dict[str, Any] | None = None) -> None:
        """Mark the bundle complete once every planned module has a record; write the run statistics."""
        missing = [n for n in self.manifest.planned if n not in self.manifest.modules]
        if missing:
            raise BundleError(f"{self.path}: {len(missing)} planned modules were not written (first: {missing[0]})")
        self.manifest.modules = {n: self.manifest.modules[n] for n in self.manifest.planned}
        self.manifest.identity = self.manifest.content_identity()
        self.manifest.complete = True
        self.manifest.baseline = None  # a finished bundle is its own baseline
        try:
            self._write_manifest()
            if stats is not None:
                write_file(self.path / STATS, json.dumps(stats, indent=2) + "\n")
        finally:
            self.close()

    def _write_manifest(self) -> None:
        write_file(self.path / MANIFEST, json.dumps(self.manifest.to_json(), indent=2) + "\n")
