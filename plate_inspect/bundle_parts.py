"""A bundle's part files: their bytes, the records their headers vouch for, and their tensors.

A part file is a safetensors file holding ``<module>.<kind>`` tensors (:data:`plate_inspect.bundle.TENSOR_KINDS`) of
its modules, and in its header (:data:`plate_inspect.bundle.PART_METADATA_KEY`) their records and the digest of the
settings that made them: a rescan or a resumed scan decides from the headers which modules it can keep.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from plate_inspect.bundle import FORMAT_NAME, PART_FILE_NAME, PART_METADATA_KEY, TENSOR_KINDS, ModuleRecord, damaged
from plate_inspect.errors import BundleError

if TYPE_CHECKING:
    from plate_inspect.bundle import Manifest, ScanSettings

__all__ = [
    "encode_part",
    "finished_modules",
    "foreign_safetensors",
    "intact_records",
    "part_records",
    "read_part_tensors",
    "records_by_part",
    "refuse_foreign_safetensors",
]


def encode_part(
    records: list[ModuleRecord],
    tensors: dict[str, torch.Tensor],
    settings: ScanSettings,
    variant: dict[str, Any] | None,
) -> bytes:
    """A part file's bytes: the tensors, and in the header the records and the settings/variant that made them."""
    meta = {
        "format": FORMAT_NAME,
        "settings": settings.digest(),
        "variant": variant,
        "records": [asdict(rec) for rec in records],
    }
    header = {PART_METADATA_KEY: json.dumps(meta, sort_keys=True)}
    return safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata=header)


def part_records(path: Path, settings: ScanSettings, variant: dict[str, Any] | None) -> dict[str, ModuleRecord]:
    """The records a part file's header vouches for, if it was made with these settings and variant (else none).

    Reads the header only. A missing, foreign, corrupt or older-format part vouches for nothing.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(PART_METADATA_KEY)
            keys = set(f.keys())
        meta = json.loads(raw) if raw else None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            return {}
        if meta.get("settings") != settings.digest() or meta.get("variant") != variant:
            return {}
        records = [ModuleRecord(**r) for r in meta["records"]]
    except Exception:  # a part that cannot be read is a part to rewrite, never an error
        return {}
    return {
        r.name: r for r in records if r.file == path.name and all(f"{r.name}.{kind}" in keys for kind in TENSOR_KINDS)
    }


def intact_records(path: Path, records: dict[str, ModuleRecord]) -> dict[str, ModuleRecord]:
    """The records whose tensors in part file ``path`` match their digests (a part that cannot be read: none)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                name: rec
                for name, rec in records.items()
                if not damaged(rec, {kind: f.get_tensor(f"{name}.{kind}") for kind in TENSOR_KINDS})
            }
    except Exception:  # safetensors' own error types: an unreadable part vouches for nothing
        return {}


def foreign_safetensors(path: Path) -> list[Path]:
    """Safetensors files in ``path`` that are not bundle part files by name (e.g. a model's weights)."""
    return [f for f in sorted(path.glob("*.safetensors")) if not PART_FILE_NAME.fullmatch(f.name)]


def refuse_foreign_safetensors(path: Path, even: str = "", elsewhere: str = "choose another --out") -> None:
    """BundleError for a directory holding a model's safetensors files (``--out`` given as the checkpoint's own
    directory): a bundle needs a directory of its own, and nothing of a model's is ever deleted."""
    foreign = foreign_safetensors(path)
    if foreign:
        names = ", ".join(f.name for f in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise BundleError(
            f"{path}: holds safetensors files that are not parts of a PLATE bundle ({names}): a model checkpoint? A "
            f"bundle needs a directory of its own, and nothing here is deleted{even}; {elsewhere}"
        )


def records_by_part(path: Path, manifest: Manifest) -> dict[str, dict[str, ModuleRecord]]:
    """Each part file's :func:`part_records` for the manifest's settings and variant, by file name (one header read
    per part: a caller that needs them twice keeps this)."""
    return {
        part.name: part_records(part, manifest.settings, manifest.variant)
        for part in sorted(path.glob("*.safetensors"))
    }


def finished_modules(
    path: Path, manifest: Manifest, parts: dict[str, dict[str, ModuleRecord]] | None = None
) -> dict[str, ModuleRecord]:
    """Planned modules whose part files (made with the manifest's settings and variant) are already written;
    ``parts``: the :func:`records_by_part` of ``path`` when the caller read them already."""
    found: dict[str, ModuleRecord] = {}
    for records in (records_by_part(path, manifest) if parts is None else parts).values():
        found.update(records)
    return {n: found[n] for n in manifest.planned if n in found}


def read_part_tensors(path: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Every stored tensor of the given modules from one part file (to carry them into a rewritten part)."""
    wanted = tuple(f"{n}." for n in names)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(wanted)}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise BundleError(f"{path}: cannot read part file ({e}); rerun with --overwrite") from None
