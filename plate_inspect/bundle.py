"""PLATE init bundle, format v1: a directory with ``manifest.json`` and ``*.safetensors`` part files.

Per module (keyed by its checkpoint name, e.g. ``model.layers.0.self_attn.q_proj``) a part file holds
``<module>.plate_B_idx`` (int64 [r], ascending), ``<module>.plate_Q`` ([d_in, k]), ``<module>.redundancy``
(float32 [d_out]) and ``<module>.spectrum`` (float32, descending). The manifest carries the source, the
settings and one :class:`ModuleRecord` per module. Parts are written atomically as they finish; the
manifest says ``complete: true`` only after the last one, so a killed scan resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from plate_inspect import __version__
from plate_inspect.errors import BundleError, PlateInspectError

FORMAT_NAME = "plate-init-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATS = "scan_stats.json"
_UMASK = os.umask(0)
os.umask(_UMASK)
Q_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ScanSettings:
    """The settings that determine a bundle's content (two scans with equal settings agree bit for bit)."""

    r: int = 64
    tau: float = 0.9
    max_rank: int = 512
    seed: int = 0
    sketch_dim: int | None = None
    anchors: int = 256
    target_modules: tuple[str, ...] | None = None
    layers: tuple[int, ...] | None = None
    precision: str = "float32"
    q_dtype: str = "float32"
    tau_grid: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("target_modules", "layers", "tau_grid"):
            d[key] = list(d[key]) if d[key] is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScanSettings:
        d = dict(d)
        for key in ("target_modules", "layers", "tau_grid"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class ModuleRecord:
    """Manifest entry for one adapted module."""

    name: str
    module_type: str
    layer: int | None
    shape: list[int]  # [d_out, d_in]
    layout: str  # linear | conv1d
    dtype: str  # stored dtype of the weight in the checkpoint
    r: int
    k: int
    captured_energy: float
    total_energy: float
    mean_redundancy: float
    k_by_tau: dict[str, int]
    fingerprint: str  # sha256 of the weight's stored bytes
    file: str  # part file that holds this module's tensors
    variant: str | None = None  # None for a scanned bundle; an ablation name for derived bundles
    health: dict | None = None  # beyond (issue 15): plate_inspect.health.health_record of W; written only when set

    @property
    def d_out(self) -> int:
        return self.shape[0]

    @property
    def d_in(self) -> int:
        return self.shape[1]

    @property
    def trainable_params(self) -> int:
        return self.r * self.k

    @property
    def lora_params(self) -> int:
        """LoRA's trainable parameters at the same rank r, for comparison."""
        return self.r * (self.d_in + self.d_out)


def _record_json(rec: ModuleRecord) -> dict[str, Any]:
    """A module record for the manifest; ``health`` only when present (beyond, issue 15)."""
    d = asdict(rec)
    if d.get("health") is None:
        d.pop("health", None)
    return d


@dataclass
class Manifest:
    source: dict[str, Any]
    settings: ScanSettings
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    planned: list[str] = field(default_factory=list)
    complete: bool = False
    source_signature: str = ""
    model_type: str | None = None
    selection_note: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    tool_version: str = __version__

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "format_version": self.format_version,
            "tool_version": self.tool_version,
            "complete": self.complete,
            "source": self.source,
            "source_signature": self.source_signature,
            "model_type": self.model_type,
            "selection": self.selection_note,
            "config": self.settings.to_json(),
            "planned": self.planned,
            "modules": {n: _record_json(m) for n, m in self.modules.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], where: Path) -> Manifest:
        if d.get("format") != FORMAT_NAME:
            raise BundleError(f"{where}: not a PLATE init bundle (format {d.get('format')!r})")
        if d.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"{where}: bundle format version {d.get('format_version')} is not supported by plate-inspect "
                f"{__version__} (reads version {FORMAT_VERSION})"
            )
        try:
            return cls(
                source=d["source"],
                settings=ScanSettings.from_json(d["config"]),
                modules={n: ModuleRecord(**m) for n, m in d["modules"].items()},
                planned=list(d.get("planned", [])),
                complete=bool(d["complete"]),
                source_signature=d.get("source_signature", ""),
                model_type=d.get("model_type"),
                selection_note=d.get("selection", ""),
                tool_version=d.get("tool_version", ""),
            )
        except (KeyError, TypeError) as e:
            raise BundleError(f"{where}: corrupt manifest ({e})") from None


@dataclass
class ModulePlate:
    """B and Q of one module, ready for a trainer."""

    record: ModuleRecord
    b_idx: torch.Tensor  # int64 [r]
    q: torch.Tensor  # [d_in, k]


class Bundle:
    """A PLATE init bundle on disk: the manifest in memory, tensors read on demand."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path = path
        self.manifest = manifest

    @classmethod
    def load(cls, path: str | os.PathLike, require_complete: bool = True) -> Bundle:
        path = Path(path)
        mpath = path / MANIFEST
        if not mpath.exists():
            raise BundleError(
                f"{path}: not a bundle (no {MANIFEST}); create one with: plate-inspect scan MODEL --out {path}"
            )
        try:
            data = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise BundleError(f"{mpath}: unreadable manifest ({e})") from None
        manifest = Manifest.from_json(data, mpath)
        if require_complete and not manifest.complete:
            done, total = len(manifest.modules), len(manifest.planned)
            raise BundleError(
                f"{path}: bundle is incomplete ({done}/{total} modules): the scan was interrupted; "
                "rerun the same scan command to resume it"
            )
        return cls(path, manifest)

    # ----------------------------------------------------------------- access
    @property
    def settings(self) -> ScanSettings:
        return self.manifest.settings

    @property
    def modules(self) -> list[str]:
        return list(self.manifest.modules)

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.modules

    def __len__(self) -> int:
        return len(self.manifest.modules)

    def __iter__(self) -> Iterator[ModuleRecord]:
        return iter(self.manifest.modules.values())

    def record(self, name: str) -> ModuleRecord:
        try:
            return self.manifest.modules[name]
        except KeyError:
            raise BundleError(f"{self.path}: no module '{name}' in this bundle") from None

    def tensor(self, name: str, kind: str) -> torch.Tensor:
        """One stored tensor: kind is plate_B_idx | plate_Q | redundancy | spectrum."""
        rec = self.record(name)
        part = self.path / rec.file
        key = f"{name}.{kind}"
        try:
            with safe_open(str(part), framework="pt") as f:
                return f.get_tensor(key)
        except FileNotFoundError:
            raise BundleError(f"{part}: part file missing (module '{name}')") from None
        except Exception as e:  # safetensors raises its own error types for corrupt files / missing keys
            raise BundleError(f"{part}: cannot read '{key}': {e}") from None

    def b_idx(self, name: str) -> torch.Tensor:
        return self.tensor(name, "plate_B_idx")

    def q(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        q = self.tensor(name, "plate_Q")
        return q.to(dtype) if dtype is not None else q

    def redundancy(self, name: str) -> torch.Tensor:
        return self.tensor(name, "redundancy")

    def spectrum(self, name: str) -> torch.Tensor:
        return self.tensor(name, "spectrum")

    def plate(self, name: str, dtype: torch.dtype | None = torch.float32) -> ModulePlate:
        return ModulePlate(self.record(name), self.b_idx(name), self.q(name, dtype))

    def stats(self) -> dict[str, Any]:
        """Run statistics of the scan that produced the bundle (wall time, bytes read, peak RSS), if recorded."""
        p = self.path / STATS
        try:
            return json.loads(p.read_text()) if p.exists() else {}
        except (OSError, json.JSONDecodeError):
            return {}


# --------------------------------------------------------------------------- writing
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory and rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _io_error(path, e) from None


def _io_error(path: Path, e: OSError) -> PlateInspectError:
    if e.errno == errno.ENOSPC:
        return BundleError(f"{path}: disk full while writing the bundle; free space and rerun to resume")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return BundleError(f"{path}: output directory is not writable ({e.strerror}); choose another --out")
    return BundleError(f"{path}: cannot write ({e.strerror or e})")


class BundleWriter:
    """Writes a bundle part by part; resumes a matching incomplete bundle; refuses to clobber others."""

    def __init__(self, path: str | os.PathLike, manifest: Manifest, overwrite: bool = False):
        self.path = Path(path)
        self.manifest = manifest
        self.overwrite = overwrite
        self.resumed_modules: set[str] = set()

    def open(self) -> Manifest:
        """Prepare the directory. Returns the manifest to continue from (with finished modules, if resuming)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-probe-"):
                pass
        except OSError as e:
            raise _io_error(self.path, e) from None
        existing = self.path / MANIFEST
        if existing.exists() and not self.overwrite:
            try:
                old = Manifest.from_json(json.loads(existing.read_text()), existing)
            except (json.JSONDecodeError, OSError, BundleError):
                raise BundleError(
                    f"{self.path}: holds something that is not a matching bundle; pass --overwrite to replace it"
                ) from None
            same = (
                old.settings == self.manifest.settings
                and old.source_signature == self.manifest.source_signature
                and old.planned == self.manifest.planned
            )
            if not same:
                state = "a finished" if old.complete else "an unfinished"
                raise BundleError(
                    f"{self.path}: holds {state} bundle made with other settings or weights; "
                    "pass --overwrite to replace it, or choose another --out"
                )
            kept = {n: m for n, m in old.modules.items() if (self.path / m.file).exists()}
            self.manifest.modules = kept
            self.manifest.complete = old.complete and len(kept) == len(old.modules)
            self.resumed_modules = set(kept)
        elif self.overwrite:
            for p in list(self.path.glob("*.safetensors")) + [existing, self.path / STATS]:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        if not self.manifest.complete:
            self._write_manifest()
        return self.manifest

    def write_part(self, part: str, records: list[ModuleRecord], tensors: dict[str, torch.Tensor]) -> None:
        """Atomically write one part file, then record its modules in the (still incomplete) manifest."""
        data = safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": FORMAT_NAME})
        atomic_write_bytes(self.path / part, data)
        for rec in records:
            self.manifest.modules[rec.name] = rec
        self._write_manifest()

    def finalize(self, stats: dict[str, Any] | None = None) -> None:
        self.manifest.modules = {n: self.manifest.modules[n] for n in self.manifest.planned}
        self.manifest.complete = True
        self._write_manifest()
        if stats is not None:
            atomic_write_bytes(self.path / STATS, (json.dumps(stats, indent=2) + "\n").encode())

    def _write_manifest(self) -> None:
        text = json.dumps(self.manifest.to_json(), indent=2, sort_keys=False) + "\n"
        atomic_write_bytes(self.path / MANIFEST, text.encode())
