"""PLATE init bundle, format v1 (v2: the same, with stack entries in the layer selection; see
:data:`STACKS_FORMAT_VERSION`): a directory with ``manifest.json`` and ``*.safetensors`` part files.

Per module (keyed by its checkpoint name, e.g. ``model.layers.0.self_attn.q_proj``) a part file holds
``<module>.plate_B_idx`` (int64 [r], ascending), ``<module>.plate_Q`` ([d_in, k]), ``<module>.redundancy``
(float32 [d_out]) and ``<module>.spectrum`` (float32, descending). The manifest carries the source, the
settings and one :class:`ModuleRecord` per module. Each part file also carries, in its safetensors header, the
records of its own modules and the digest of the settings that made them: a part is self-describing, so a
rescan or a resumed (possibly distributed) scan decides from the part headers and the weights' fingerprints
which modules are still valid. The manifest says ``complete: true`` only after the last part is written.

A bundle's identity (:func:`content_identity`) is its settings, its variant (for ablation bundles) and, per
module, the sha256 fingerprint of the weight's stored bytes with its dtype, shape and layout.

This module holds the format: its constants, :class:`ScanSettings`, :class:`ModuleRecord`, :class:`Manifest` and
the digests and identities computed from them. Built on it, each with one job: :mod:`plate_inspect.bundle_parts`
(part files: encoding, the records their headers vouch for, reading their tensors), :mod:`plate_inspect.bundle_reader`
(:class:`Bundle`: a bundle on disk, read and checked) and :mod:`plate_inspect.bundle_writer` (:class:`BundleWriter`).
Their public names are importable from here too (the path callers have used), looked up on first use: those
modules import this one.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import numbers
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plate_inspect import __version__
from plate_inspect.arguments import finite_numbers
from plate_inspect.dtypes import PRECISIONS
from plate_inspect.dtypes import Q_DTYPES as Q_DTYPES  # re-exported: the bundle's Q dtypes
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.formatting import counted
from plate_inspect.geometry import DEFAULT_TAU_GRID, validate_settings
from plate_inspect.targets import LayerEntry, layer_entries, name_list

if TYPE_CHECKING:  # at run time these come through __getattr__ below (their modules import this one)
    from plate_inspect.bundle_parts import (
        encode_part,
        finished_modules,
        foreign_safetensors,
        intact_records,
        part_records,
        read_part_tensors,
        refuse_foreign_safetensors,
    )
    from plate_inspect.bundle_reader import Bundle, ModulePlate, not_a_bundle, read_problem, stored_b_problem
    from plate_inspect.bundle_writer import (
        API_REPLACE_HINT,
        REPLACE_HINT,
        BundleWriter,
        describe_variant,
        rescan_baseline,
        write_file,
    )

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "MANIFEST_MEND",
    "PART_FILE_NAME",
    "PART_METADATA_KEY",
    "Q_DTYPES",
    "READ_FORMAT_VERSIONS",
    "SELECTION_SETTINGS",
    "STACKS_FORMAT_VERSION",
    "STATS",
    "TENSOR_KINDS",
    "Manifest",
    "ModuleRecord",
    "ScanSettings",
    "changed_since_baseline",
    "content_identity",
    "damaged",
    "geometry_digest",
    "scores_digest",
    "unfinished_note",
    "unfinished_state",
    "weight_key",
    "weight_key_json",
    "encode_part",
    "finished_modules",
    "foreign_safetensors",
    "intact_records",
    "part_records",
    "read_part_tensors",
    "refuse_foreign_safetensors",
    "Bundle",
    "ModulePlate",
    "not_a_bundle",
    "read_problem",
    "stored_b_problem",
    "API_REPLACE_HINT",
    "REPLACE_HINT",
    "BundleWriter",
    "describe_variant",
    "rescan_baseline",
    "write_file",
]

FORMAT_NAME = "plate-init-bundle"
FORMAT_VERSION = 1
#: The format version of a bundle whose layer selection holds stack entries (``'decoder:3'``, ``'decoder'``; every
#: other bundle stays version 1). Nothing else differs, but readers before them read ``layers`` as ints
#: (``int('decoder:3')``: a ValueError traceback) and refuse a format version other than 1 with one line.
STACKS_FORMAT_VERSION = 2
#: The format versions this version reads.
READ_FORMAT_VERSIONS = (FORMAT_VERSION, STACKS_FORMAT_VERSION)
MANIFEST = "manifest.json"
#: The tensors a bundle stores per module, as ``<module>.<kind>`` (:meth:`Bundle.tensor`).
TENSOR_KINDS = ("plate_B_idx", "plate_Q", "redundancy", "spectrum")
STATS = "scan_stats.json"
#: The one metadata key of a part file's safetensors header (one key: safetensors orders several at random).
PART_METADATA_KEY = "plate_part"
#: Names of a bundle's part files (plate_inspect.scanner.part_name): layer-00003.safetensors,
#: layer-00003-experts-0001.safetensors, other.safetensors. Any other safetensors file is not the bundle's.
PART_FILE_NAME = re.compile(r"(layer-\d{5}(-experts-\d{4})?|other)\.safetensors")


#: Settings added after format v1 first shipped, with the value every earlier bundle was made with. At that value
#: they are left out of the settings digest and the identity, so bundles made before keep both.
_LATER_SETTINGS: dict[str, object] = {"include_mtp": False}


#: Settings that only choose which modules a scan plans. Their spelling is not what counts but what they select:
#: two values that plan the same modules of the checkpoint (``layers=[0, 1, 2]`` and all layers of a 3-layer model,
#: ``q_proj,v_proj`` and ``v_proj,q_proj``, ``include_mtp`` on a model without a multi-token-prediction layer or
#: with it outside ``layers``) make the same bundle, so a rescan spelling them differently is accepted.
SELECTION_SETTINGS = frozenset({"target_modules", "layers", "include_mtp"})


#: What to do about a manifest that cannot be read or makes no sense.
MANIFEST_MEND = (
    "the bundle's record is damaged: rescan the model into it with overwrite=True (CLI: --overwrite), or into "
    "another directory"
)


@dataclass(frozen=True)
class ScanSettings:
    """The settings that determine a bundle's content (two scans with equal settings agree bit for bit).

    The one carrier of a scan's settings: :func:`plate_inspect.scanner.plan_scan` and the CLI take it whole.
    Values are checked and normalised on construction; bad ones raise ConfigError. The constructor takes any
    iterable of names (one string: one name), layer entries and taus; the fields hold tuples (a sorted tau grid).
    """

    r: int = 64
    tau: float = 0.9
    max_rank: int = 512
    seed: int = 0
    sketch_dim: int | None = None
    anchors: int = 256
    target_modules: tuple[str, ...] | None = None  # names, suffixes, regexes or module types; None: the defaults
    layers: tuple[LayerEntry, ...] | None = None  # ints (every stack's layer i), 'stack:i' and 'stack' strings
    precision: str = "float32"
    q_dtype: str = "float32"
    tau_grid: tuple[float, ...] = DEFAULT_TAU_GRID
    include_mtp: bool = False  # DeepSeek's multi-token-prediction layer: it changes the planned modules

    if TYPE_CHECKING:  # what the constructor takes; __post_init__ normalises it into the fields' types above

        def __init__(
            self,
            r: int = 64,
            tau: float = 0.9,
            max_rank: int = 512,
            seed: int = 0,
            sketch_dim: int | None = None,
            anchors: int = 256,
            target_modules: str | Iterable[str] | None = None,  # one string is one name
            layers: Iterable[LayerEntry] | None = None,
            precision: str = "float32",
            q_dtype: str = "float32",
            tau_grid: Iterable[float] = DEFAULT_TAU_GRID,
            include_mtp: bool = False,
        ) -> None: ...

    def __post_init__(self) -> None:
        validate_settings(
            r=self.r, tau=self.tau, max_rank=self.max_rank, n_anchors=self.anchors, sketch_dim=self.sketch_dim
        )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.q_dtype not in Q_DTYPES:
            raise ConfigError(f"q dtype must be one of {sorted(Q_DTYPES)}, got {self.q_dtype!r}")
        if not (isinstance(self.include_mtp, int) and self.include_mtp in (0, 1)):  # 'no' was read as True
            raise ConfigError(f"include_mtp must be True or False, got {self.include_mtp!r:.80}")
        grid = tuple(sorted(set(finite_numbers(self.tau_grid, "tau_grid", empty=True))))  # None: TypeError
        if any(not 0 < t < 1 for t in grid):
            raise ConfigError(f"tau grid values must lie strictly between 0 and 1, got {list(grid)}")
        normal = {
            "tau": float(self.tau),
            "seed": int(self.seed),
            "target_modules": tuple(name_list(self.target_modules)) if self.target_modules else None,
            "layers": layer_entries(self.layers) if self.layers is not None else None,
            "tau_grid": grid,
            "include_mtp": bool(self.include_mtp),
        }
        for key, value in normal.items():
            object.__setattr__(self, key, value)

    def to_json(self) -> dict[str, Any]:
        """The settings as the manifest's ``config`` holds them (lists for tuples)."""
        d = asdict(self)
        for key in ("target_modules", "layers", "tau_grid"):
            d[key] = list(d[key]) if d[key] is not None else None
        return d

    def canonical(self) -> dict[str, Any]:
        """What the digest and the identity cover: :meth:`to_json` less later settings at their old value."""
        return {k: v for k, v in self.to_json().items() if k not in _LATER_SETTINGS or _LATER_SETTINGS[k] != v}

    def digest(self) -> str:
        """sha256 of the canonical JSON of these settings."""
        return _digest(self.canonical())

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScanSettings:
        """Settings from a manifest's ``config`` (keys this version does not know are ignored), checked."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def geometry_digest(b_idx: torch.Tensor, q: torch.Tensor) -> str:
    """Identity of one module's geometry: sha256 over B (int64) and Q widened to float32 (independent of Q's dtype).

    A bundle stores Q in float32, bfloat16 or float16; all of them widen to float32 exactly, so the digest of the
    bundle's Q is the same whatever dtype a trainer holds it in. Compute it from the bundle's Q, not from a Q that
    was rounded in memory (``model.to(torch.bfloat16)`` rounds buffers too).
    """
    h = hashlib.sha256()
    h.update(b_idx.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    qc = q.detach().to("cpu", torch.float32).contiguous()
    h.update(b"float32" + str(list(qc.shape)).encode())
    h.update(qc.view(torch.uint8).numpy().tobytes() if qc.numel() else b"")
    return "sha256:" + h.hexdigest()


def scores_digest(redundancy: torch.Tensor, spectrum: torch.Tensor) -> str:
    """Identity of one module's stored redundancy scores and spectrum (sha256 of dtype, shape and bytes): what plan,
    variants and reports read besides B and Q, so damage to them is caught like damage to B and Q."""
    h = hashlib.sha256()
    for t in (redundancy, spectrum):
        tc = t.detach().to("cpu").contiguous()
        h.update(f"{tc.dtype}{list(tc.shape)}".encode())
        h.update(tc.view(torch.uint8).numpy().tobytes() if tc.numel() else b"")
    return "sha256:" + h.hexdigest()


def damaged(rec: ModuleRecord, tensors: dict[str, torch.Tensor]) -> str:
    """'' if a module's stored tensors (by kind: plate_B_idx, plate_Q, redundancy, spectrum) match the digests its
    record holds (records without digests, from older scans, match), else which of them differ."""
    if rec.geometry_digest and geometry_digest(tensors["plate_B_idx"], tensors["plate_Q"]) != rec.geometry_digest:
        return "B or Q"
    if rec.scores_digest and scores_digest(tensors["redundancy"], tensors["spectrum"]) != rec.scores_digest:
        return "redundancy scores or spectrum"
    return ""


@dataclass
class ModuleRecord:
    """Manifest entry for one adapted module."""

    name: str
    module_type: str
    layer: int | None
    shape: list[int]  # [d_out, d_in]
    layout: str  # one of plate_inspect.targets.LAYOUTS: linear, conv1d, experts_out_major, experts_in_major
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
    geometry_digest: str | None = None  # geometry_digest(B, Q as stored), checked by verify; None in older bundles
    scores_digest: str | None = None  # scores_digest(redundancy, spectrum as stored); None in older bundles

    def __repr__(self) -> str:
        """One line: what a notebook shows of a module (the dataclass repr spelled out every field, the health
        dict's and k_by_tau's entries included: ~1 kB a record)."""
        extras = f", variant={self.variant!r}" if self.variant is not None else ""
        extras += ", health" if self.health else ""
        return (
            f"ModuleRecord({self.name!r}, {self.module_type}, layer={self.layer}, shape={list(self.shape)} "
            f"{self.layout} {self.dtype}, r={self.r}, k={self.k}, captured_energy={self.captured_energy:.3g}, "
            f"file={self.file!r}{extras})"
        )

    @property
    def d_out(self) -> int:
        """Output features (rows of W)."""
        return self.shape[0]

    @property
    def d_in(self) -> int:
        """Input features (columns of W)."""
        return self.shape[1]

    @property
    def trainable_params(self) -> int:
        """PLATE's trainable parameters for this module: A is r x k."""
        return self.r * self.k

    @property
    def lora_params(self) -> int:
        """LoRA's trainable parameters at the same rank r, for comparison."""
        return self.r * (self.d_in + self.d_out)


def _record_json(rec: ModuleRecord) -> dict[str, Any]:
    """A module record for the manifest; ``health`` and the digests only when present."""
    d = asdict(rec)
    for optional in ("health", "geometry_digest", "scores_digest"):
        if d.get(optional) is None:
            d.pop(optional, None)
    return d


@dataclass
class Manifest:
    """A bundle's manifest.json in memory: the source, the settings, one record per module, and whether the scan
    finished (an unfinished one lists the modules it planned)."""

    source: dict[str, Any]
    settings: ScanSettings
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    planned: list[str] = field(default_factory=list)
    complete: bool = False
    source_signature: str = ""
    model_type: str | None = None
    selection_note: str = ""
    variant: dict[str, Any] | None = None  # {"kind", "seed", "base_identity"} for ablation bundles
    identity: str = ""  # content_identity(), written when the bundle completes
    #: While a rescan of a finished bundle is unfinished: that bundle's weight_key per module (as JSON lists), kept
    #: across interruptions so the run that finishes can say how many modules changed since the bundle was made.
    baseline: dict[str, list] | None = None
    format: str = FORMAT_NAME
    tool_version: str = __version__

    def __repr__(self) -> str:
        """One line: a MoE bundle's manifest holds ~15k records (the dataclass repr printed them all, ~10 MB)."""
        state = "complete" if self.complete else f"unfinished, {len(self.modules)} of {len(self.planned)} modules"
        return (
            f"Manifest(source={self.source.get('id')!r}, model_type={self.model_type!r}, modules={len(self.modules)}, "
            f"r={self.settings.r}, tau={self.settings.tau}, max_rank={self.settings.max_rank}, {state})"
        )

    @property
    def format_version(self) -> int:
        """:data:`STACKS_FORMAT_VERSION` where the layer selection holds stack entries, else :data:`FORMAT_VERSION`
        (so older plate-inspect versions refuse such a bundle cleanly and read every other one)."""
        stacked = any(isinstance(entry, str) for entry in self.settings.layers or ())
        return STACKS_FORMAT_VERSION if stacked else FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """manifest.json's content."""
        extra = {"rescan_baseline": self.baseline} if self.baseline is not None else {}
        return {
            "format": self.format,
            "format_version": self.format_version,
            "tool_version": self.tool_version,
            "complete": self.complete,
            "identity": self.identity,
            "variant": self.variant,
            "source": self.source,
            "source_signature": self.source_signature,
            "model_type": self.model_type,
            "selection": self.selection_note,
            "config": self.settings.to_json(),
            "planned": self.planned,
            "modules": {n: _record_json(m) for n, m in self.modules.items()},
            **extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], where: Path) -> Manifest:
        """The manifest in ``d`` (manifest.json's content, read from ``where``); BundleError when it is not one."""
        if not isinstance(d, dict):
            raise BundleError(f"{where}: corrupt manifest (not a JSON object); {MANIFEST_MEND}")
        if d.get("format") != FORMAT_NAME:
            raise BundleError(f"{where}: not a PLATE init bundle (format {d.get('format')!r})")
        if d.get("format_version") not in READ_FORMAT_VERSIONS:
            raise BundleError(
                f"{where}: bundle format version {d.get('format_version')} is not supported by plate-inspect "
                f"{__version__} (reads versions {', '.join(map(str, READ_FORMAT_VERSIONS))}); read it with a newer "
                "plate-inspect"
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
                variant=d.get("variant"),
                identity=d.get("identity", ""),
                baseline=_baseline(d.get("rescan_baseline")),
                tool_version=d.get("tool_version", ""),
            )
        except (KeyError, TypeError, AttributeError, ConfigError) as e:  # missing keys, wrong types, bad settings
            raise BundleError(f"{where}: corrupt manifest ({type(e).__name__}: {e}); {MANIFEST_MEND}") from None

    def content_identity(self) -> str:
        """The identity of this bundle's content: settings, variant, and every module's weight fingerprint."""
        return content_identity(self.settings, self.variant, self.modules.values())


def _rescan_recomputed(manifest: Manifest) -> int | None:
    """How many modules an interrupted rescan of a finished bundle recomputed; None for an interrupted first scan.
    A rescan's part files hold every module of the bundle it updates, so 'written' says nothing there: the modules
    whose weights differ from that bundle's are the ones it recomputed."""
    changed = changed_since_baseline(manifest)
    return None if changed is None else len(changed)


def unfinished_state(manifest: Manifest) -> str:
    """How far an unfinished bundle got (its ``modules``: those its part files hold): '3 of 14 modules written', or
    'all 14 modules written, not finalised' when only the manifest's completion is missing; for an interrupted
    rescan, 'rescan interrupted after recomputing 3 modules'."""
    done, total = len(manifest.modules), len(manifest.planned)
    rescan = _rescan_recomputed(manifest)
    if rescan is not None:
        missing = f", {total - done} of {total} not written" if done < total else ""
        return f"rescan interrupted after recomputing {counted(rescan, 'module')}{missing}"
    if total and done == total:
        return f"all {total} modules written, not finalised"
    return f"{done} of {total} modules written"


def unfinished_note(manifest: Manifest) -> str:
    """What is wrong with an unfinished bundle and what to do, as one sentence (for errors, ``info`` and ``verify``)."""
    done, total = len(manifest.modules), len(manifest.planned)
    rescan = _rescan_recomputed(manifest)
    if rescan is not None:
        missing = f"; {total - done} of its {total} modules have no part file" if done < total else ""
        return (
            "bundle is being rescanned: the rescan was interrupted after recomputing "
            f"{counted(rescan, 'module')} for changed weights (the others still hold the geometry of the weights "
            f"the bundle was made from){missing}; rerun the same scan command to finish it (only modules whose "
            "weights changed are recomputed)"
        )
    if total and done == total:
        return (
            f"bundle is not finalised: all {total} modules are written, but the scan stopped before it marked the "
            "manifest complete; rerun the same scan command to finish it (the written modules are kept)"
        )
    return (
        f"bundle is incomplete: {done} of {total} modules written, the scan was interrupted; rerun the same scan "
        "command to resume it"
    )


def _digest(obj: Any) -> str:
    """sha256 of ``obj``'s canonical JSON (keys sorted), in full: a value stored in manifests (settings and content
    identity), so it stays this digest. ``distributed.identity.digest`` is not the same on purpose: a short digest
    that the ranks of one run compare (and key their store entries by), same code and key order on every rank,
    never written into a bundle."""
    return "sha256:" + hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def weight_key(rec: ModuleRecord) -> tuple[str, str, tuple[int, ...], str]:
    """What a module's result depends on besides the settings: its weight's bytes, dtype, shape and layout."""
    return (rec.fingerprint, rec.dtype, tuple(rec.shape), rec.layout)


def weight_key_json(rec: ModuleRecord) -> list:
    """:func:`weight_key` as the manifest's ``rescan_baseline`` stores it (JSON lists)."""
    return [rec.fingerprint, rec.dtype, list(rec.shape), rec.layout]


def _baseline(value: Any) -> dict[str, list] | None:
    """A manifest's ``rescan_baseline`` (None when absent or malformed: it only informs the change count)."""
    if isinstance(value, dict) and all(isinstance(v, list) for v in value.values()):
        return value
    return None


def changed_since_baseline(manifest: Manifest) -> set[str] | None:
    """Modules whose weights differ from those of the finished bundle an (interrupted) rescan updates; None when
    the manifest records no such bundle (a fresh scan, or one made before the baseline was recorded)."""
    if manifest.baseline is None:
        return None
    base = manifest.baseline
    return {n for n, rec in manifest.modules.items() if n in base and base[n] != weight_key_json(rec)}


def content_identity(settings: ScanSettings, variant: dict[str, Any] | None, records: Iterable[ModuleRecord]) -> str:
    """sha256 over the settings, the variant and (name, fingerprint, dtype, shape, layout) of every module."""
    modules = sorted([rec.name, *weight_key(rec)] for rec in records)
    return _digest({"settings": settings.canonical(), "variant": variant, "modules": modules})


#: The public names of the modules built on this one, by name: importable from here, looked up on first use.
_MOVED = {
    "encode_part": "plate_inspect.bundle_parts",
    "finished_modules": "plate_inspect.bundle_parts",
    "foreign_safetensors": "plate_inspect.bundle_parts",
    "intact_records": "plate_inspect.bundle_parts",
    "part_records": "plate_inspect.bundle_parts",
    "read_part_tensors": "plate_inspect.bundle_parts",
    "refuse_foreign_safetensors": "plate_inspect.bundle_parts",
    "Bundle": "plate_inspect.bundle_reader",
    "ModulePlate": "plate_inspect.bundle_reader",
    "not_a_bundle": "plate_inspect.bundle_reader",
    "read_problem": "plate_inspect.bundle_reader",
    "stored_b_problem": "plate_inspect.bundle_reader",
    "API_REPLACE_HINT": "plate_inspect.bundle_writer",
    "REPLACE_HINT": "plate_inspect.bundle_writer",
    "BundleWriter": "plate_inspect.bundle_writer",
    "describe_variant": "plate_inspect.bundle_writer",
    "rescan_baseline": "plate_inspect.bundle_writer",
    "write_file": "plate_inspect.bundle_writer",
}


def __getattr__(name: str) -> object:
    """A name of bundle_parts, bundle_reader or bundle_writer at its public place (``plate_inspect.bundle.Bundle``):
    imported on first use, as those modules import this one."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly from now on
    return value
