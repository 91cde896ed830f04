"""The streaming audit (:func:`audit`): BASE's targets, their B (a bundle's or chosen as the scan chooses them), one
module at a time."""

import json
import os
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from plate_inspect.atomic import path_argument
from plate_inspect.auditing.measures import AuditRecord, audit_update
from plate_inspect.auditing.sources import CheckpointUpdate, UpdateSource, open_update
from plate_inspect.bundle import Bundle, ScanSettings
from plate_inspect.checkpoint import (
    Checkpoint,
)
from plate_inspect.dtypes import PRECISIONS
from plate_inspect.errors import BundleError, CheckpointError, ConfigError
from plate_inspect.geometry import (
    check_sketch_dim,
    effective_r,
    module_seed,
    redundancy_scores,
    select_redundant_rows,
)
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import (
    LayerEntry,
    TargetModule,
    check_target_patterns,
    format_layers,
    layers_there,
    load_target,
    modules_by_name,
    select_layers,
    select_targets,
    target_matches,
)


# --------------------------------------------------------------------------- the streaming driver
def targets_by_name(ckpt: Checkpoint, names: list[str]) -> list[TargetModule]:
    """TargetModules for named modules of a checkpoint (names as a bundle records them, 3-D expert slices
    included), in scan order (layer, then name)."""
    modules = modules_by_name(ckpt)
    out = []
    for name in names:
        target = modules.get(name)
        if target is None:
            raise CheckpointError(f"{ckpt.root}: no 2-D weight '{name}.weight' in the base checkpoint")
        out.append(target)
    out.sort(key=lambda t: (t.layer if t.layer is not None else 1 << 30, t.name))
    return out


def bundle_origin(bundle: Bundle) -> str:
    """Which model a bundle was scanned from, as a user recognises it: source (and revision), model_type, identity."""
    m = bundle.manifest
    src = m.source or {}
    where = str(src.get("id") or "an unknown source")
    if src.get("kind") == "hub" and src.get("revision"):
        where += f"@{src['revision']}"
    parts = [where]
    if m.model_type:
        parts.append(f"model_type {m.model_type}")
    parts.append(f"{len(m.modules)} modules")
    if m.identity:
        parts.append(f"identity {m.identity[:19]}...")
    return f"{parts[0]} ({', '.join(parts[1:])})"


def check_bundle_fits_base(
    bundle: Bundle, base_ckpt: Checkpoint, base: str | os.PathLike, adapter: str | os.PathLike | None = None
) -> None:
    """A bundle of another model (modules BASE lacks, or of other shapes) is refused before any weight is read,
    naming the model the bundle was made for; ``adapter``: the bundle is that PLATE adapter's own. Same modules and
    shapes but other weights (a fine-tune, another revision) are caught by the per-module fingerprint check while
    streaming."""
    modules = modules_by_name(base_ckpt)
    absent = [n for n in bundle.modules if n not in modules]
    reshaped = [n for n in bundle.modules if n in modules and list(modules[n].shape) != list(bundle.record(n).shape)]
    if not absent and not reshaped:
        return
    if absent:
        example = f"'{absent[0]}' is not in BASE"
    else:
        name = reshaped[0]
        example = f"'{name}' is {list(bundle.record(name).shape)} there, {list(modules[name].shape)} in BASE"
    base_type = base_ckpt.config.get("model_type")
    if adapter is None:
        whose, todo = (
            "",
            (
                f"pass the bundle of BASE (plate-inspect scan {shlex.quote(str(base))} --out DIR, then --bundle "
                "DIR), audit against the model the bundle was scanned from, or leave out --bundle (B is then chosen "
                "as the scan does)"
            ),
        )
    else:
        whose = f" (the bundle of the PLATE adapter {adapter})"
        todo = "the adapter was trained on that model: pass it as BASE"
    raise BundleError(
        f"{bundle.path}{whose}: the bundle was made for another model, {bundle_origin(bundle)}, not for BASE {base}"
        + (f" (model_type {base_type})" if base_type else "")
        + f": {len(absent) + len(reshaped)} of its {len(bundle.modules)} modules do not fit BASE ({example}); {todo}"
    )


def refuse_ablation_bundle(bundle: Bundle) -> None:
    """An ablation bundle (Random-B, Least-redundant-B, Random-Q, ...) given as the audit's bundle: its B is not
    PLATE's redundant rows (or it is, but its Q is not PLATE's), so the shares would be scored against a geometry
    PLATE never uses, with nothing in the output saying so. Refused, naming the bundle it was made from. (A PLATE
    adapter trained from an ablation bundle is audited against that bundle: that is the adapter's own geometry.)"""
    variant = bundle.manifest.variant
    if not variant:
        return
    kind = variant.get("kind", "an ablation") if isinstance(variant, dict) else str(variant)
    origin = bundle.stats().get("from")
    made_from = f" of {origin}" if origin else ""
    use = f"--bundle {origin}" if origin else "the PLATE bundle it was made from as --bundle"
    raise ConfigError(
        f"{bundle.path}: is a {kind} ablation bundle{made_from}; the audit scores an update against PLATE's B and "
        f"protected directions, which an ablation bundle does not hold; give {use}, or leave out --bundle (B is "
        "then chosen as the scan chooses it)"
    )


def _refuse_bundle_dir(path: str | os.PathLike, role: str) -> None:
    """BASE or TUNED given as a PLATE init bundle directory (its part files look like safetensors checkpoints)."""
    p = Path(path).expanduser()
    manifest = p / "manifest.json"
    if not (p.is_dir() and manifest.is_file()):
        return
    try:
        fmt = json.loads(manifest.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return
    if fmt == "plate-init-bundle":
        raise ConfigError(
            f"{p}: is a PLATE init bundle, not a model; {role} must be a checkpoint"
            + (" or an adapter" if role == "TUNED" else "")
            + "; to take B from it, give it as the bundle (CLI: --bundle) and the model it was scanned from as BASE"
        )


def select_by_filters(
    targets: list[TargetModule],
    target_modules: list[str] | None,
    layers: Sequence[LayerEntry] | None,
    what: str,
    model_names: Iterable[str] | None = None,
) -> list[TargetModule]:
    """The targets of a bundle or adapter that ``target_modules`` (names, suffixes, regexes, module types, as scan
    matches them) and ``layers`` (plain or stack-qualified, as scan's) select; a selection that keeps nothing is a
    ConfigError. ``model_names``: the model's modules, whose layer stacks ``'decoder:3'`` entries name (default:
    the targets', which may hold one stack of an encoder-decoder)."""
    if not target_modules and layers is None:
        return targets
    check_target_patterns(target_modules)
    names = [t.name for t in targets] if model_names is None else model_names
    kept = targets if layers is None else select_layers(targets, layers, names)
    kept = [t for t in kept if not target_modules or target_matches(t, target_modules)]
    if not kept:
        asked = " and ".join(
            ([f"target modules {','.join(target_modules)}"] if target_modules else [])
            + ([f"layers {format_layers(layers)}"] if layers is not None else [])
        )
        types = sorted({t.module_type for t in targets})
        spans = layers_there((t.name for t in targets), names)
        raise ConfigError(
            f"the selection ({asked}) keeps none of the {len(targets)} modules of {what}; its module types: "
            f"{', '.join(types[:20])}" + (f"; its layers: {spans}" if spans != "none" else "")
        )
    return kept


def audit(
    base: str | os.PathLike,
    tuned: str | os.PathLike,
    bundle: Bundle | str | os.PathLike | None = None,
    tau: float = 0.9,
    *,
    r: int = 64,
    anchors: int = 256,
    sketch_dim: int | None = None,
    seed: int = 0,
    target_modules: str | Iterable[str] | None = None,
    layers: Iterable[LayerEntry] | None = None,
    precision: str = "float32",
    revision: str | None = None,
    offline: bool | None = None,
    progress: ProgressCallback | None = None,
) -> list[AuditRecord]:
    """Audit TUNED against BASE, one module at a time; records in scan order (see :func:`rank_by_risk`).

    B comes from ``bundle`` (which must have been scanned from BASE: a bundle of another model is refused by name,
    and fingerprints are checked); without one, from a PLATE adapter's own bundle; otherwise B is chosen as the
    scan does with ``r``, ``anchors``, ``sketch_dim`` and ``seed``. Modules: the adapter's, else the bundle's, else
    the scan's targets; ``target_modules`` and ``layers`` narrow any of these. ``progress`` gets one event per module
    (unit "modules"). The settings are checked and normalised as :class:`ScanSettings` checks a scan's (one
    string in ``target_modules`` is one name, as in :func:`plate_inspect.scan`).
    """
    path_argument(base, "base")  # a clear error for None, not a TypeError from deep inside
    path_argument(tuned, "tuned")
    settings = ScanSettings(
        r=r,
        tau=tau,
        seed=seed,
        sketch_dim=sketch_dim,
        anchors=anchors,
        target_modules=target_modules,  # ScanSettings reads one string as one name, any iterable as names
        layers=layers,
        precision=precision,
    )
    check_target_patterns(settings.target_modules)
    dtype = PRECISIONS[settings.precision]
    _refuse_bundle_dir(base, "BASE")
    _refuse_bundle_dir(tuned, "TUNED")
    given = bundle if isinstance(bundle, Bundle) or bundle is None else Bundle.load(path_argument(bundle, "bundle"))
    if given is not None:
        refuse_ablation_bundle(given)
    base_ckpt = Checkpoint.open(base, revision=revision, offline=offline)
    if given is not None:
        check_bundle_fits_base(given, base_ckpt, base)
    source = open_update(tuned, bundle=given, revision=revision, offline=offline)
    geometry = given if given is not None else source.bundle
    if given is None and geometry is not None:
        check_bundle_fits_base(geometry, base_ckpt, base, adapter=tuned)
    targets = _audit_targets(base_ckpt, source, geometry, settings, tuned)
    if geometry is None:  # before any weight is read
        check_sketch_dim(settings.sketch_dim, [(target.name, target.shape[1]) for target in targets])
    records = []
    counter = ProgressCounter(as_callback(progress, "audit"), len(targets), "modules")
    counter.start()
    for target in targets:
        stored, fingerprint = load_target(base_ckpt, target)
        weight = stored.to(dtype).contiguous()
        del stored
        b_idx = _audit_b_idx(target, weight, fingerprint, geometry, settings, base)
        delta = source.delta(target, weight)
        record = audit_update(target.name, weight, delta, b_idx, settings.tau)
        if isinstance(source, CheckpointUpdate):
            if target.name in source.rounded:
                record.base_rounded_to, record.rounding_floor = source.rounded[target.name]
            record.tuned_rounds_to_base = source.base_is_rounded_tuned.get(target.name)
        records.append(record)
        del weight, delta
        counter.step(target.name)
    return records


def _audit_targets(
    base_ckpt: Checkpoint,
    source: UpdateSource,
    geometry: Bundle | None,
    settings: ScanSettings,
    tuned: str | os.PathLike,
) -> list[TargetModule]:
    """The modules to audit, before any weight is read: the adapter's, else the bundle's, else the scan's targets,
    narrowed by ``settings``' target_modules and layers. Each must have geometry in ``geometry`` (when given) and,
    for a fine-tuned checkpoint, a weight of the same shape in TUNED."""
    target_modules = list(settings.target_modules) if settings.target_modules else None
    layers = settings.layers
    names = source.bind(base_ckpt)
    model = modules_by_name(base_ckpt) if layers is not None else None  # the stacks 'decoder:3' names
    if names is not None:
        targets = select_by_filters(
            targets_by_name(base_ckpt, names), target_modules, layers, f"the adapter {tuned}", model
        )
    elif geometry is not None:
        targets = select_by_filters(
            targets_by_name(base_ckpt, geometry.modules), target_modules, layers, f"the bundle {geometry.path}", model
        )
    else:
        targets, _ = select_targets(base_ckpt, target_modules, layers)
    if geometry is not None:
        missing = [t.name for t in targets if t.name not in geometry]
        if missing:
            raise BundleError(
                f"{geometry.path}: has no geometry for module '{missing[0]}' that the update touches; "
                "scan the base model with these modules (--target-modules) or audit without --bundle"
            )
    if isinstance(source, CheckpointUpdate):
        source.check_targets(targets, base_ckpt)
    return targets


def _audit_b_idx(
    target: TargetModule,
    weight: torch.Tensor,
    fingerprint: str,
    geometry: Bundle | None,
    settings: ScanSettings,
    base: str | os.PathLike,
) -> torch.Tensor:
    """B of one module: the bundle's (refused when it was scanned from other weights than BASE's), else chosen as
    the scan chooses it (redundancy scores with the settings' anchors, sketch and per-module seed; the top r)."""
    if geometry is None:
        scores = redundancy_scores(
            weight,
            n_anchors=settings.anchors,
            sketch_dim=settings.sketch_dim,
            seed=module_seed(settings.seed, target.name),
        )
        return select_redundant_rows(scores, effective_r(settings.r, target.shape[0]))
    rec = geometry.record(target.name)
    if list(rec.shape) != list(target.shape) or rec.fingerprint != fingerprint:
        raise BundleError(
            f"{geometry.path}: module '{target.name}' was scanned from other weights than BASE {base} "
            f"(weight fingerprint differs; the bundle was scanned from {bundle_origin(geometry)}); pass the "
            "bundle of the base model, not of a fine-tune or another revision"
        )
    return geometry.checked_b_idx(rec.name, with_digest=True)
