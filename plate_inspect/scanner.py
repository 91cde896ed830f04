"""The streaming scanner: checkpoint in, PLATE init bundle out, one weight in memory at a time.

For each target module it reads the weight's stored bytes once (fingerprint + tensor), upcasts to the
compute precision, runs :func:`plate_inspect.geometry.plate_geometry`, and frees it. Modules of one layer
are written together as one part file; a killed scan resumes from the last finished part.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plate_inspect.bundle import Q_DTYPES, Bundle, BundleWriter, Manifest, ModuleRecord, ScanSettings
from plate_inspect.checkpoint import Checkpoint, require_float_dtype
from plate_inspect.errors import CheckpointError, ConfigError
from plate_inspect.geometry import DEFAULT_TAU_GRID, module_seed, plate_geometry, validate_settings
from plate_inspect.health import health_of_weight  # beyond (issue 15)
from plate_inspect.targets import TargetModule, load_target, select_targets

PRECISIONS = {"float32": torch.float32, "float64": torch.float64}


class ScanProgress:
    """Callbacks a front end implements to show progress; the default does nothing."""

    def start(self, total_modules: int, total_bytes: int, already_done: int, already_bytes: int) -> None: ...

    def module_done(self, name: str, nbytes: int) -> None: ...

    def finish(self) -> None: ...


@dataclass
class ScanPlan:
    """What a scan will do, before it reads any weight."""

    checkpoint: Checkpoint
    targets: list[TargetModule]
    selection_note: str
    settings: ScanSettings


def part_name(target: TargetModule) -> str:
    """Part file for a module: one per layer index, plus ``other`` for modules outside numbered layers."""
    return f"layer-{target.layer:05d}.safetensors" if target.layer is not None else "other.safetensors"


def plan_scan(
    source: str | os.PathLike,
    *,
    r: int = 64,
    tau: float = 0.9,
    max_rank: int = 512,
    seed: int = 0,
    sketch_dim: int | None = None,
    anchors: int = 256,
    target_modules: Iterable[str] | None = None,
    layers: Iterable[int] | None = None,
    precision: str = "float32",
    q_dtype: str = "float32",
    tau_grid: Iterable[float] = DEFAULT_TAU_GRID,
    revision: str | None = None,
    offline: bool | None = None,
) -> ScanPlan:
    """Validate settings, open the checkpoint lazily and choose target modules."""
    validate_settings(r=r, tau=tau, max_rank=max_rank, n_anchors=anchors, sketch_dim=sketch_dim)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if q_dtype not in Q_DTYPES:
        raise ConfigError(f"q dtype must be one of {sorted(Q_DTYPES)}, got {q_dtype!r}")
    grid = tuple(sorted({float(t) for t in tau_grid}))
    if any(not 0 < t < 1 for t in grid):
        raise ConfigError(f"tau grid values must lie strictly between 0 and 1, got {list(grid)}")
    settings = ScanSettings(
        r=r,
        tau=float(tau),
        max_rank=max_rank,
        seed=seed,
        sketch_dim=sketch_dim,
        anchors=anchors,
        target_modules=tuple(target_modules) if target_modules else None,
        layers=tuple(layers) if layers is not None else None,
        precision=precision,
        q_dtype=q_dtype,
        tau_grid=grid,
    )
    ckpt = Checkpoint.open(source, revision=revision, offline=offline)
    targets, note = select_targets(ckpt, list(settings.target_modules or []) or None, settings.layers)
    for target in targets:  # fail before any work, not halfway through a long scan
        require_float_dtype(target.tensor)
    return ScanPlan(ckpt, targets, note, settings)


def scan(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    device: str = "cpu",
    progress: ScanProgress | None = None,
    **settings: Any,
) -> Bundle:
    """Scan a checkpoint (local dir, .safetensors file or hub repo id) and write a PLATE init bundle.

    ``settings`` are those of :func:`plan_scan` (r, tau, max_rank, seed, sketch_dim, anchors,
    target_modules, layers, precision, q_dtype, tau_grid, revision, offline). Rerunning the same call
    after an interruption resumes; a finished bundle with the same settings is returned as is.
    """
    return run_scan(plan_scan(source, **settings), out, overwrite=overwrite, device=device, progress=progress)


def run_scan(
    plan: ScanPlan,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    device: str = "cpu",
    progress: ScanProgress | None = None,
) -> Bundle:
    """Execute a :class:`ScanPlan`, writing the bundle to ``out``."""
    progress = progress or ScanProgress()
    dev = _resolve_device(device)
    ckpt, settings = plan.checkpoint, plan.settings
    source = ckpt.source.to_json() if ckpt.source else {"kind": "local", "id": str(ckpt.root)}
    manifest = Manifest(
        source=source,
        settings=settings,
        planned=[t.name for t in plan.targets],
        source_signature=ckpt.signature(),
        model_type=ckpt.config.get("model_type"),
        selection_note=plan.selection_note,
    )
    writer = BundleWriter(out, manifest, overwrite=overwrite)
    manifest = writer.open()
    if manifest.complete:
        return Bundle.load(out)

    started = time.perf_counter()
    total_bytes = sum(t.tensor.nbytes for t in plan.targets)
    done_bytes = sum(t.tensor.nbytes for t in plan.targets if t.name in manifest.modules)
    progress.start(len(plan.targets), total_bytes, len(manifest.modules), done_bytes)
    groups: dict[str, list[TargetModule]] = {}
    for t in plan.targets:
        groups.setdefault(part_name(t), []).append(t)
    todo = [
        (part, t)
        for part, members in groups.items()
        if not all(m.name in manifest.modules for m in members)
        for t in members
    ]
    # One reader thread keeps the next weight's bytes coming from disk while this one is computed: at most
    # one extra stored weight in memory, and disk time overlaps compute.
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plate-read")
    try:
        upcoming = reader.submit(load_target, ckpt, todo[0][1]) if todo else None
        tensors: dict[str, torch.Tensor] = {}
        records: list[ModuleRecord] = []
        for i, (part, target) in enumerate(todo):
            oriented, fingerprint = upcoming.result()
            upcoming = reader.submit(load_target, ckpt, todo[i + 1][1]) if i + 1 < len(todo) else None
            record, module_tensors = _scan_module(oriented, fingerprint, target, settings, dev, part)
            del oriented
            records.append(record)
            tensors.update(module_tensors)
            progress.module_done(target.name, target.tensor.nbytes)
            if i + 1 == len(todo) or todo[i + 1][0] != part:
                writer.write_part(part, records, tensors)
                tensors, records = {}, []
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        progress.finish()
    stats = {
        "wall_seconds": round(time.perf_counter() - started, 3),
        "bytes_read": ckpt.bytes_read,
        "peak_rss_bytes": peak_rss_bytes(),
        "modules_scanned": len(plan.targets) - len(writer.resumed_modules),
        "modules_resumed": len(writer.resumed_modules),
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
    }
    writer.finalize(stats)
    return Bundle.load(out)


def _scan_module(
    oriented: torch.Tensor,
    fingerprint: str,
    target: TargetModule,
    settings: ScanSettings,
    device: torch.device,
    part: str,
) -> tuple[ModuleRecord, dict[str, torch.Tensor]]:
    """Geometry and bundle record of one module from its d_out x d_in weight (consumed: freed here)."""
    weight = oriented.to(device=device, dtype=PRECISIONS[settings.precision]).contiguous()
    del oriented
    # a sum is non-finite if any element is (or on overflow, where the exact check below clears it)
    if not math.isfinite(float(weight.sum())) and not bool(torch.isfinite(weight).all()):
        raise CheckpointError(
            f"{target.tensor.file.name}: tensor '{target.tensor.name}' contains NaN or Inf values; "
            "the checkpoint is corrupt or was saved after a diverged run"
        )
    health = health_of_weight(weight)  # beyond (issue 15): W's own spectrum, before B's rows are zeroed in place
    geo = plate_geometry(
        weight,
        settings.r,
        settings.tau,
        settings.max_rank,
        n_anchors=settings.anchors,
        sketch_dim=settings.sketch_dim,
        seed=module_seed(settings.seed, target.name),
        tau_grid=settings.tau_grid,
        overwrite_input=True,
    )
    del weight
    basis = geo.basis
    record = ModuleRecord(
        name=target.name,
        module_type=target.module_type,
        layer=target.layer,
        shape=list(target.shape),
        layout=target.layout,
        dtype=target.tensor.dtype,
        r=int(geo.b_idx.numel()),
        k=basis.k,
        captured_energy=float(basis.captured_energy),
        total_energy=float(basis.spectrum.double().sum()),
        mean_redundancy=float(geo.redundancy.double().mean()),
        k_by_tau={f"{t:g}": k for t, k in geo.k_by_tau.items()},
        fingerprint=fingerprint,
        file=part,
        health=health,  # beyond (issue 15)
    )
    tensors = {
        f"{target.name}.plate_B_idx": geo.b_idx,
        f"{target.name}.plate_Q": basis.q.to("cpu", Q_DTYPES[settings.q_dtype]),
        f"{target.name}.redundancy": geo.redundancy,
        f"{target.name}.spectrum": basis.spectrum.cpu(),
    }
    return record, tensors


def _resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {device!r}")
    return dev


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far.

    Reads VmHWM from /proc (reset at exec); getrusage's ru_maxrss is a fallback only, since Linux carries it
    over from the parent across fork+exec and would report the launcher's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def default_out_dir(source: str | os.PathLike) -> Path:
    """bundles/<model name> in the working directory."""
    name = Path(str(source).rstrip("/")).name.removesuffix(".safetensors") or "model"
    return Path("bundles") / name
