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
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import json
import numbers
import os
import re
import shlex
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from plate_inspect import __version__
from plate_inspect.arguments import finite_numbers
from plate_inspect.atomic import atomic_write, path_argument, stale_temps
from plate_inspect.dtypes import PRECISIONS
from plate_inspect.dtypes import Q_DTYPES as Q_DTYPES  # re-exported: the bundle's Q dtypes
from plate_inspect.errors import BundleError, ConfigError, PlateInspectError, os_error_text
from plate_inspect.formatting import counted
from plate_inspect.geometry import DEFAULT_TAU_GRID, validate_settings
from plate_inspect.targets import LayerEntry, layer_entries, name_list

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


#: What to do about an output directory that holds another bundle, for Python and CLI users alike.
#: What to do about a manifest that cannot be read or makes no sense.
_MANIFEST_MEND = (
    "the bundle's record is damaged: rescan the model into it with overwrite=True (CLI: --overwrite), or into "
    "another directory"
)
REPLACE_HINT = "replace it with overwrite=True (CLI: --overwrite), or write elsewhere (CLI: --out)"
#: The same for writers with no CLI command (``make_variant``): the Python keywords only.
API_REPLACE_HINT = "replace it with overwrite=True, or write elsewhere (another out)"


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
        from plate_inspect.checkpoint import parse_safetensors_header

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
            raise BundleError(f"{where}: corrupt manifest (not a JSON object); {_MANIFEST_MEND}")
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
            raise BundleError(f"{where}: corrupt manifest ({type(e).__name__}: {e}); {_MANIFEST_MEND}") from None

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


def rescan_baseline(path: Path, old: Manifest) -> tuple[dict[str, list], list[str]]:
    """What a rescan counts changes against, for a finished bundle ``old`` in ``path``: each module's weight key
    from its part file's header (what the scan checks the weights against to keep a module), from its manifest
    record where no part vouches for it; and the modules whose manifest record disagrees with their part header
    (an edited manifest: the rescan rewrites it from the part files)."""
    headers = finished_modules(path, old)
    baseline, disagree = {}, []
    for name, rec in old.modules.items():
        header = headers.get(name)
        if header is not None and weight_key(header) != weight_key(rec):
            disagree.append(name)
        baseline[name] = weight_key_json(header or rec)
    return baseline, disagree


def content_identity(settings: ScanSettings, variant: dict[str, Any] | None, records: Iterable[ModuleRecord]) -> str:
    """sha256 over the settings, the variant and (name, fingerprint, dtype, shape, layout) of every module."""
    modules = sorted([rec.name, *weight_key(rec)] for rec in records)
    return _digest({"settings": settings.canonical(), "variant": variant, "modules": modules})


@dataclass
class ModulePlate:
    """B and Q of one module, ready for a trainer."""

    record: ModuleRecord
    b_idx: torch.Tensor  # int64 [r]
    q: torch.Tensor  # [d_in, k]


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


class Bundle:
    """A PLATE init bundle on disk: the manifest in memory, tensors read on demand."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._mixed_up: dict[str, str] = {}  # part file -> what it holds instead of its modules (read failures only)

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
            raise BundleError(f"{mpath}: unreadable manifest ({e}); {_MANIFEST_MEND}") from None
        manifest = Manifest.from_json(data, mpath)
        if not manifest.complete:  # the finished modules of an unfinished scan are recorded in the part headers
            manifest.modules = finished_modules(path, manifest)
        if require_complete and not manifest.complete:
            raise BundleError(f"{path}: {unfinished_note(manifest)}")
        return cls(path, manifest)

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
            with safe_open(str(part), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt files / missing keys
            mixed = "" if isinstance(e, FileNotFoundError) else self._part_mixed_up(rec.file)
            raise self.damaged(name, f"the part file {mixed}" if mixed else read_problem(e, key)) from None

    def _part_mixed_up(self, file: str) -> str:
        """:meth:`mixed_up` of a part file whose tensor could not be read ('' if its header cannot be read either);
        once per file (verify reads every module of a swapped part)."""
        from plate_inspect.checkpoint import parse_safetensors_header

        if file not in self._mixed_up:
            try:
                entries, _ = parse_safetensors_header(self.path / file)
                self._mixed_up[file] = self.mixed_up(file, entries)
            except PlateInspectError:
                self._mixed_up[file] = ""
        return self._mixed_up[file]

    def mixed_up(self, file: str, keys: Iterable[str]) -> str:
        """'' when part file ``file`` (tensor names ``keys``) holds every tensor of the modules the manifest puts in
        it; else what it holds instead: another part's modules (part files renamed or swapped by hand), or too few.

        Said once with the modules named, where a read would say only that one tensor is not in the file."""
        keys = set(keys)
        mine = [rec for rec in self if rec.file == file]
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
        from plate_inspect.checkpoint import parse_safetensors_header

        problems = {}
        for file in sorted({rec.file for rec in self.manifest.modules.values()}):
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
        n_parts = len({rec.file for rec in self.manifest.modules.values()})
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


# --------------------------------------------------------------------------- part files
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
    kinds = ("plate_B_idx", "plate_Q", "redundancy", "spectrum")
    return {r.name: r for r in records if r.file == path.name and all(f"{r.name}.{kind}" in keys for kind in kinds)}


def intact_records(path: Path, records: dict[str, ModuleRecord]) -> dict[str, ModuleRecord]:
    """The records whose tensors in part file ``path`` match their digests (a part that cannot be read: none)."""
    kinds = ("plate_B_idx", "plate_Q", "redundancy", "spectrum")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                name: rec
                for name, rec in records.items()
                if not damaged(rec, {kind: f.get_tensor(f"{name}.{kind}") for kind in kinds})
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


def finished_modules(path: Path, manifest: Manifest) -> dict[str, ModuleRecord]:
    """Planned modules whose part files (made with the manifest's settings and variant) are already written."""
    found: dict[str, ModuleRecord] = {}
    for part in sorted(path.glob("*.safetensors")):
        found.update(part_records(part, manifest.settings, manifest.variant))
    return {n: found[n] for n in manifest.planned if n in found}


def read_part_tensors(path: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Every stored tensor of the given modules from one part file (to carry them into a rewritten part)."""
    wanted = tuple(f"{n}." for n in names)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(wanted)}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise BundleError(f"{path}: cannot read part file ({e}); rerun with --overwrite") from None


# --------------------------------------------------------------------------- writing
def describe_variant(variant: dict[str, Any] | None) -> str:
    """'a scanned bundle' or 'the random_q ablation (seed 1) of bundle sha256:0123abcd...'."""
    if not variant:
        return "a scanned bundle"
    base = str(variant.get("base_identity", ""))
    return f"the {variant.get('kind')} ablation (seed {variant.get('seed')}) of bundle {base[:15]}..."


def _io_error(path: Path, e: OSError) -> PlateInspectError:
    if e.errno == errno.ENOSPC:
        return BundleError(f"{path}: disk full while writing the bundle; free space and rerun to resume")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
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
            if old.complete:
                self.manifest.baseline, self.manifest_disagrees = rescan_baseline(self.path, old)
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
