"""The streaming scanner: checkpoint in, PLATE init bundle out, one weight in memory at a time.

For each target module it reads the weight's stored bytes once (fingerprint + tensor). If the existing part
file already holds this module's result for these exact bytes, the module is kept; otherwise the same bytes are
upcast to the compute precision, run through :func:`plate_inspect.geometry.plate_geometry`, and freed. Modules of
one layer are written together as one part file, so a killed scan resumes from the last finished part and a
rescan of changed weights recomputes exactly the changed modules. Under torchrun each rank scans its share of
the parts (:mod:`plate_inspect.distributed`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plate_inspect import distributed
from plate_inspect.arguments import positive_int
from plate_inspect.batched import DEFAULT_GROUP_SIZE, batched_plate_geometry, expert_groups
from plate_inspect.bundle import (
    FORMAT_NAME,
    MANIFEST,
    Bundle,
    BundleWriter,
    Manifest,
    ModuleRecord,
    ScanSettings,
    changed_since_baseline,
    geometry_digest,
    read_part_tensors,
    refuse_foreign_safetensors,
    scores_digest,
    weight_key,
)
from plate_inspect.checkpoint import Checkpoint, require_float_dtype
from plate_inspect.dtypes import PRECISIONS, Q_DTYPES
from plate_inspect.errors import BundleError, CheckpointError, ConfigError
from plate_inspect.geometry import DEFAULT_TAU_GRID, ModuleGeometry, check_sketch_dim, module_seed, plate_geometry
from plate_inspect.health import health_record
from plate_inspect.layer_selection import format_layers, span
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import (
    TargetModule,
    layer_entry,
    layer_list,
    layers_there,
    load_target,
    select_targets,
    stack_of,
    unmatched_target_patterns,
)


class ScanProgress:
    """Deprecated (one release): the old scan front end. Pass ``progress=`` a function of one ProgressEvent."""

    def start(self, total_modules: int, total_bytes: int, already_done: int, already_bytes: int) -> None:
        """Called once before the first module: what the scan will read, and what an earlier run already did."""

    def module_done(self, name: str, nbytes: int) -> None:
        """Called after each module is written, with its stored bytes."""

    def finish(self) -> None:
        """Called once when the scan is done."""


@dataclass
class ScanPlan:
    """What a scan will do, before it reads any weight."""

    checkpoint: Checkpoint
    targets: list[TargetModule]
    selection_note: str
    settings: ScanSettings
    notes: list[str] = field(default_factory=list)  # said before the scan (the CLI prints them)

    def __repr__(self) -> str:
        """One short line (a REPL shows it): the checkpoint, how many targets, the settings; not every tensor."""
        return f"ScanPlan({self.checkpoint!r}, targets={len(self.targets)}, {self.settings!r})"


#: Experts per part file: a part is written (and held in memory) whole, and a DeepSeek-V3 layer has 768 experts.
EXPERTS_PER_PART = 8


def part_name(target: TargetModule) -> str:
    """Part file for a module: one per layer index (experts: one per EXPERTS_PER_PART experts of the layer), plus
    ``other`` for modules outside numbered layers. Memory is bounded by one part's tensors, not by a layer's."""
    if target.layer is None:
        return "other.safetensors"
    if target.expert is None:
        return f"layer-{target.layer:05d}.safetensors"
    return f"layer-{target.layer:05d}-experts-{target.expert // EXPERTS_PER_PART:04d}.safetensors"


def plan_scan(
    source: str | os.PathLike,
    settings: ScanSettings | None = None,
    *,
    revision: str | None = None,
    offline: bool | None = None,
) -> ScanPlan:
    """Open the checkpoint lazily and choose the target modules for these settings (default: ScanSettings())."""
    settings = settings if settings is not None else ScanSettings()
    refuse_bundle_as_model(source)
    ckpt = Checkpoint.open(source, revision=revision, offline=offline)
    targets, note = select_targets(ckpt, settings.target_modules, settings.layers, include_mtp=settings.include_mtp)
    for target in targets:  # fail before any work, not halfway through a long scan
        require_float_dtype(ckpt.logical_weight(target.logical_name))
    check_sketch_dim(settings.sketch_dim, [(target.name, target.shape[1]) for target in targets])
    unmatched = unmatched_target_patterns(ckpt, settings.target_modules, targets, settings.layers is not None)
    absent = absent_layers_note(ckpt, settings.layers)
    return ScanPlan(ckpt, targets, note, settings, [n for n in (unmatched, absent) if n])


def absent_layers_note(ckpt: Checkpoint, layers: Iterable[object] | None) -> str:
    """A note naming the plain ``--layers`` indices that no layer of the checkpoint has ('' when each exists):
    ``--layers 0-5`` on a 2-layer model scanned layers 0-1 without a word. (A selection that keeps nothing is
    refused by select_targets; a 'stack:i' entry past its stack is refused there too.)"""
    if layers is None:
        return ""
    entries = [layer_entry(e) for e in layer_list(layers)]
    wanted = {i for stack, i in entries if not stack and i is not None}
    present = {at[1] for name in ckpt.tensors if (at := stack_of(name)) is not None}
    absent = wanted - present
    if not absent:
        return ""
    where = "this shard (one file of a sharded model)" if ckpt.one_shard else "this checkpoint"
    plain = all(not stack for stack, _ in entries)
    these = f"layers {span(absent)} are" if len(absent) > 1 else f"layer {span(absent)} is"
    return (
        f"--layers {span(wanted) if plain else format_layers(layers)}: {these} not in {where} (its layers: "
        f"{layers_there(ckpt.tensors)}); scanning "
        + (f"layers {span(wanted & present)}" if plain else "the rest of the selection")
    )


def refuse_bundle_as_model(source: str | os.PathLike) -> None:
    """A PLATE bundle (or one of its part files) given as the model to scan: its part files are safetensors, so
    without this it read as a model with no layer weights ("no target modules matched")."""
    path = Path(source).expanduser()
    bundle_dir = path if path.is_dir() else path.parent
    if not path.exists() or not (bundle_dir / MANIFEST).is_file():
        return
    try:
        manifest = json.loads((bundle_dir / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return
    made_from = manifest.get("source", {}).get("id") if isinstance(manifest.get("source"), dict) else None
    what = "a PLATE init bundle" if path.is_dir() else f"a part file of the PLATE init bundle {bundle_dir}"
    raise CheckpointError(
        f"{path}: is {what} (plate-inspect scan output), not a model; scan the model it was made from"
        + (f" ({made_from})" if made_from else "")
        + " (plate-inspect info shows a bundle)"
    )


def check_out_dir(out: str | os.PathLike, option: str = "--out") -> None:
    """Refuse an --out that cannot hold a bundle before the checkpoint is opened (a hub model would be downloaded
    first): a file in the way, a directory that is not writable, or one holding a model's safetensors files.
    ``option``: the flag the message names (merge's ``--rescan``)."""
    out = Path(out)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        what = "it is" if existing == out else f"{existing} is"
        raise BundleError(f"{out}: cannot write the bundle: {what} a file, not a directory; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BundleError(f"{existing}: output directory is not writable; choose another {option}")
    if existing == out:
        refuse_foreign_safetensors(out)


def scan(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    r: int = 64,
    tau: float = 0.9,
    max_rank: int = 512,
    seed: int = 0,
    sketch_dim: int | None = None,
    anchors: int = 256,
    target_modules: str | Iterable[str] | None = None,
    layers: Iterable[int | str] | None = None,
    precision: str = "float32",
    q_dtype: str = "float32",
    tau_grid: Iterable[float] = DEFAULT_TAU_GRID,
    include_mtp: bool = False,
    revision: str | None = None,
    offline: bool | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    devices: str | Sequence[str] | None = None,
    progress: ProgressCallback | None = None,
) -> Bundle:
    """Scan a checkpoint (local dir, .safetensors file or hub repo id) and write a PLATE init bundle.

    The settings keywords are the fields of :class:`ScanSettings` (:func:`plan_scan` + :func:`run_scan` take
    one whole). Rerunning the same call resumes an interrupted scan and rescans a finished one incrementally:
    every target weight is read and hashed once, and only modules whose weights changed are recomputed.
    ``devices`` (e.g. ``"cuda:0,cuda:1"`` or ``"all"``) runs one worker per device; under torchrun each rank
    scans its share (see :mod:`plate_inspect.distributed`). ``progress`` gets one event per module.
    """
    settings = ScanSettings(
        r=r,
        tau=tau,
        max_rank=max_rank,
        seed=seed,
        sketch_dim=sketch_dim,
        anchors=anchors,
        target_modules=target_modules,
        layers=layers,
        precision=precision,
        q_dtype=q_dtype,
        tau_grid=tau_grid,
        include_mtp=include_mtp,
    )
    progress = as_callback(progress, "scan")  # here, so that a deprecation warning names the function called
    check_out_dir(out)
    check_devices(device, devices)
    plan = plan_scan(source, settings, revision=revision, offline=offline)
    return run_scan(plan, out, overwrite=overwrite, device=device, devices=devices, progress=progress)


@dataclass
class ShareResult:
    """What one process did: the records of its parts (kept or computed), its run statistics and the names of the
    modules it computed (the others it kept)."""

    records: list[ModuleRecord]
    stats: dict[str, Any]
    computed: list[str] = field(default_factory=list)


def check_devices(device: str = "cpu", devices: str | Sequence[str] | None = None) -> None:
    """ConfigError for a ``device`` / ``devices`` this machine cannot run (``--device cuda`` without a GPU, ``mps``,
    both given): call it before the checkpoint is opened, since opening a hub model downloads its weights first
    (a 140 GB download, then "no CUDA device"). :func:`run_scan` applies the same rules."""
    if devices is not None:
        if device not in ("cpu", None):
            raise ConfigError(f"give either --devices ({devices}) or --device ({device}), not both")
        distributed.parse_devices(devices)
    else:
        _resolve_device(device)


def check_run_arguments(
    device: str = "cpu", devices: str | Sequence[str] | None = None, expert_group: int | None = None
) -> None:
    """ConfigError for :func:`run_scan` keywords it would refuse (:func:`check_devices`' rules, an ``expert_group``
    that is not a positive integer), without a plan or an output: run_scan checks them before it touches ``out``, and
    a rescan before its merge writes."""
    check_devices(device, devices)
    if expert_group is not None:
        positive_int(expert_group, "expert_group")


def run_scan(
    plan: ScanPlan,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    device: str = "cpu",
    devices: str | Sequence[str] | None = None,
    progress: ProgressCallback | None = None,
    expert_group: int | None = None,
) -> Bundle:
    """Execute a :class:`ScanPlan`, writing the bundle to ``out`` (alone, as a torchrun rank, or on ``devices``).

    ``progress`` gets one event per module of this process's share (unit "modules", with bytes read); under torchrun,
    on rank 0, each also carries the whole job's (``ProgressEvent.job``, see :mod:`plate_inspect.progress`).
    ``expert_group``: experts of one projection solved per batched eigensolve (default: 64 on CUDA, 1 on CPU).
    """
    progress = as_callback(progress, "run_scan")
    check_run_arguments(device, devices, expert_group)
    if devices is not None:
        if device not in ("cpu", None):
            raise ConfigError(f"give either --devices ({devices}) or --device ({device}), not both")
        names = distributed.parse_devices(devices)
        if len(names) > 1:
            if distributed.rank_from_env().world_size > 1:
                raise ConfigError("--devices starts its own workers; under torchrun give --device instead")
            return distributed.scan_on_devices(plan, out, names, overwrite=overwrite, progress=progress)
        device = names[0]
    ckpt, settings = plan.checkpoint, plan.settings
    source = source_record(ckpt)
    manifest = Manifest(
        source=source,
        settings=settings,
        planned=[t.name for t in plan.targets],
        source_signature=ckpt.signature(),
        model_type=ckpt.config.get("model_type"),
        selection_note=plan.selection_note,
    )
    writer = BundleWriter(out, manifest, overwrite=overwrite)
    with distributed.join() as group, closing(writer):  # closing: the directory lock goes with any error
        dev = distributed.rank_device(_resolve_device(device), group.info)
        group_size = _group_size(dev, expert_group)
        group.agree(distributed.plan_identity(plan), "the scan plan")  # before any rank touches the directory
        # the directory is checked (and cleared with overwrite) before any rank writes; every rank goes on with the
        # settings it resolved to (an equivalent spelling of the bundle's own: its part files stay valid)
        opened = group.on_root(writer.open)
        if opened is not None:
            writer.manifest.settings, writer.manifest.selection_note = opened.settings, opened.selection_note
        parts = parts_of(plan.targets)
        costs = [(part, sum(distributed.module_cost(*t.shape) for t in members)) for part, members in parts.items()]
        mine = distributed.assign_parts(costs, group.world_size)[group.rank]
        # under torchrun rank 0's events also carry the whole job's progress, the last one after the gather
        with group.job_progress(progress, len(plan.targets), sum(t.nbytes for t in plan.targets)) as share_progress:
            result = _scan_share(ckpt, {p: parts[p] for p in mine}, writer, dev, share_progress, group_size)
            results = group.gather(result)
        # every rank gets the final manifest from rank 0 (no rank re-reads a file another node just wrote)
        final = group.on_root(lambda: _finish(writer, results or [], group.world_size))
    assert final is not None  # rank 0's manifest, on every rank (on_root raises rank 0's error instead)
    return Bundle(Path(out), final)


def parts_of(targets: list[TargetModule]) -> dict[str, list[TargetModule]]:
    """Targets grouped by part file, in plan order."""
    groups: dict[str, list[TargetModule]] = {}
    for t in targets:
        groups.setdefault(part_name(t), []).append(t)
    return groups


def _scan_share(
    ckpt: Checkpoint,
    parts: dict[str, list[TargetModule]],
    writer: BundleWriter,
    device: torch.device,
    progress: ProgressCallback | None,
    group_size: int = 1,
) -> ShareResult:
    """Scan this process's parts: read and hash every weight once; compute only modules no part header vouches for.

    A module is kept when its existing part file (same settings) holds a record whose weight fingerprint, dtype,
    shape and layout equal the weight just read; a part is rewritten only if one of its modules was computed.
    Same-shaped experts of a part are read and solved together in groups of ``group_size`` (plate_inspect.batched).
    Weights are read one work item ahead (:func:`_read_ahead`, at a lower CPU priority); a second thread makes
    each part's records (with their health metrics) and writes (and fsyncs) the part file while the next part
    computes. Leaving, by return or by error, waits for that write.
    """
    started = time.perf_counter()
    items = expert_groups([(part, t) for part, members in parts.items() for t in members], group_size)
    counter = ProgressCounter(
        progress, sum(len(m) for _, m in items), "modules", bytes_total=sum(t.nbytes for _, m in items for t in m)
    )
    counter.start()
    settings = writer.manifest.settings
    tally = {"reused": 0, "changed": 0}
    computed: list[str] = []  # names of the modules this process computed (the one tally of them)
    records_out: list[ModuleRecord] = []
    state = _PartState({})
    written: Future[list[ModuleRecord]] | None = None  # the part being written while the next one computes
    buffer = UpcastBuffer()
    with (
        closing(_read_ahead(ckpt, [members for _, members in items], pin=device.type == "cuda")) as weights,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="plate-write") as part_writer,  # exit: waits for it
    ):
        for i, (part, members) in enumerate(items):
            loaded = next(weights)  # (not zipped: zip's reused result tuple would keep this item's weights alive)
            if i == 0 or items[i - 1][0] != part:
                state = _PartState(writer.reusable(part))
            todo = state.triage(members, loaded)
            tally["changed"] += sum(t.name in state.old for t, _ in todo)
            del loaded
            for target, geo, fingerprint in _compute(todo, settings, device, buffer):
                state.add(target, geo, fingerprint)
            del todo
            for target in members:
                counter.step(target.name, nbytes=target.nbytes)
            if i + 1 == len(items) or items[i + 1][0] != part:
                if written is not None:  # at most one part waits for its write; a failed write raises here
                    records_out.extend(written.result())
                written = part_writer.submit(state.close, writer, part, parts[part], tally, computed)
        if written is not None:
            records_out.extend(written.result())
    stats = {
        "wall_seconds": round(time.perf_counter() - started, 3),
        "bytes_read": ckpt.bytes_read,
        "peak_rss_bytes": peak_rss_bytes(),
        "modules_scanned": len(computed),
        "modules_resumed": tally["reused"],
        "modules_changed": tally["changed"],
        "modules_damaged": len(writer.damaged),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "blas_threads": blas_threads(),
    }
    return ShareResult(records_out, stats, computed)


#: Niceness of the scan's reader thread (Linux, where it is per thread); see _yield_to_compute.
READER_NICENESS = 10


def _yield_to_compute() -> None:
    """Lower the calling thread's CPU priority (the reader's), so that reading and hashing run on the cycles the linear
    algebra leaves free instead of taking a core from one of its BLAS threads (a multi-threaded BLAS call runs at
    the pace of its slowest thread). Linux only; elsewhere, or if refused, the thread keeps its priority. 10, not
    19: a reader at 19 would crawl on a machine busy with other work. Used for the reader only: a part writer
    that yields too keeps its layer's tensors and bytes alive into the next layer (7B: +0.1-0.16 GB peak RSS)."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        with contextlib.suppress(OSError):  # never raises a priority (the process may already run niced)
            niceness = max(os.getpriority(os.PRIO_PROCESS, thread), READER_NICENESS)
            os.setpriority(os.PRIO_PROCESS, thread, niceness)


def _read_ahead(
    ckpt: Checkpoint, items: list[list[TargetModule]], pin: bool
) -> Generator[list[tuple[torch.Tensor, str]], None, None]:
    """Each work item's (oriented weight, fingerprint) pairs, read and hashed by one thread one item ahead.

    Disk time and hashing overlap compute, with at most one extra item in memory. ``pin``: the weights come in
    page-locked host memory, so their copy to a CUDA device is a fast DMA (used when the scan computes on CUDA).
    """
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plate-read", initializer=_yield_to_compute)
    try:
        upcoming = reader.submit(_load_all, ckpt, items[0], pin) if items else None
        for i in range(len(items)):
            assert upcoming is not None  # item i was submitted: i < len(items)
            loaded = [upcoming.result()]  # the old future (which holds the result too) is dropped just below
            upcoming = reader.submit(_load_all, ckpt, items[i + 1], pin) if i + 1 < len(items) else None
            yield loaded.pop()  # this frame keeps no reference while the caller computes
    finally:
        reader.shutdown(wait=True, cancel_futures=True)


@dataclass
class _PartState:
    """One part file being assembled: its reusable records on disk, the records and tensors so far, what was kept."""

    old: dict[str, ModuleRecord]
    by_name: dict[str, ModuleRecord] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    computed: list[tuple[TargetModule, ModuleGeometry, str]] = field(default_factory=list)

    def triage(
        self, members: list[TargetModule], loaded: list[tuple[torch.Tensor, str]]
    ) -> list[tuple[TargetModule, tuple[torch.Tensor, str]]]:
        """Keep the members whose stored record matches the weight just read; return the rest, to compute."""
        todo = []
        for target, (oriented, fingerprint) in zip(members, loaded, strict=True):
            prior = self.old.get(target.name)
            if prior is not None and weight_key(prior) == (
                fingerprint,
                target.tensor.dtype,
                tuple(target.shape),
                target.layout,
            ):
                self.by_name[target.name] = prior
                self.kept.append(target.name)
            else:
                todo.append((target, (oriented, fingerprint)))
        return todo

    def add(self, target: TargetModule, geo: ModuleGeometry, fingerprint: str) -> None:
        """A freshly computed module (its record is made when the part closes)."""
        self.computed.append((target, geo, fingerprint))

    def close(
        self,
        writer: BundleWriter,
        part: str,
        members: list[TargetModule],
        tally: dict[str, int],
        computed: list[str],
    ) -> list[ModuleRecord]:
        """Make the computed modules' records (health metrics included) and tensors, write the part (or leave it
        alone when every module was kept) and return its records in plan order (``computed`` gets the names of the
        modules computed, not kept; ``tally`` counts the kept ones)."""
        settings = writer.manifest.settings
        for target, geo, fingerprint in self.computed:
            self.by_name[target.name], tensors = module_outputs(target, geo, fingerprint, settings, part)
            self.tensors.update(tensors)
        self.computed.clear()
        records = [self.by_name[t.name] for t in members]
        tally["reused"] += len(self.kept)
        kept = set(self.kept)
        computed.extend(t.name for t in members if t.name not in kept)
        if len(self.kept) == len(records) and set(self.old) == set(self.kept):
            writer.add_records(records)  # the part on disk is exactly this part: leave it alone
        else:
            self.tensors.update(read_part_tensors(writer.path / part, self.kept) if self.kept else {})
            writer.write_part(part, records, self.tensors)
        return records


def _compute(
    todo: list[tuple[TargetModule, tuple[torch.Tensor, str]]],
    settings: ScanSettings,
    device: torch.device,
    buffer: UpcastBuffer | None = None,
) -> list[tuple[TargetModule, ModuleGeometry, str]]:
    """(target, geometry, fingerprint) of the modules to compute: one alone (upcast into ``buffer``), same-shaped
    experts batched."""
    if len(todo) == 1:
        (target, (oriented, fingerprint)), todo[:] = todo[0], []  # the caller's list no longer holds the weight
        return [(target, _scan_module(oriented, target, settings, device, buffer), fingerprint)]
    if not todo:
        return []
    targets = [t for t, _ in todo]
    geos = _scan_group([w for _, (w, _) in todo], targets, settings, device)
    return [(t, geo, fp) for (t, (_, fp)), geo in zip(todo, geos, strict=True)]


def _finish(writer: BundleWriter, results: list[ShareResult], world_size: int) -> Manifest:
    """Rank 0, after every rank's parts are written: the complete manifest and the merged run statistics."""
    if world_size > 1:  # ranks with node-local directories under one --out path: no complete manifest here
        distributed.require_shared_out(writer.path, [sorted({rec.file for rec in r.records}) for r in results])
    for result in results:
        writer.add_records(result.records)
    ranks = [r.stats for r in results]
    stats = dict(ranks[0])
    for key in ("bytes_read", "modules_scanned", "modules_resumed", "modules_changed", "modules_damaged"):
        stats[key] = sum(s.get(key, 0) for s in ranks)
    stats["wall_seconds"] = max(s["wall_seconds"] for s in ranks)
    stats["peak_rss_bytes"] = max(s["peak_rss_bytes"] for s in ranks)
    stats["modules_total"] = len(writer.manifest.planned)
    # a rescan that resumes an interrupted rescan: changed since the finished bundle was made, not just this run's
    changed = changed_since_baseline(writer.manifest)
    if changed is not None:
        now = {name for result in results for name in result.computed}
        stats["modules_changed"] = len(changed)
        stats["modules_changed_earlier"] = len(changed - now)  # recomputed by the interrupted run(s), kept by this one
    stats["resumed"] = writer.resumed
    if writer.manifest_disagrees:  # an edited manifest: its records were not what the part files were made from
        stats["manifest_disagreed"] = writer.manifest_disagrees
    if world_size > 1:
        stats["world_size"] = world_size
        stats["ranks"] = ranks
    writer.finalize(stats)
    return writer.manifest


def blas_threads() -> list[dict[str, Any]]:
    """Thread pools that decide the bits of the linear algebra (OpenBLAS/MKL/OpenMP as loaded), via threadpoolctl."""
    from threadpoolctl import threadpool_info

    keys = ("user_api", "internal_api", "num_threads", "version", "prefix")
    return [{k: pool.get(k) for k in keys} for pool in threadpool_info()]


def _load_all(ckpt: Checkpoint, targets: list[TargetModule], pin: bool = False) -> list[tuple[torch.Tensor, str]]:
    loaded = [load_target(ckpt, t) for t in targets]
    return [(w.pin_memory(), fp) for w, fp in loaded] if pin else loaded


def _group_size(device: torch.device, expert_group: int | None) -> int:
    """Experts per batched eigensolve: the given number, else DEFAULT_GROUP_SIZE on CUDA and 1 (none) on CPU."""
    if expert_group is not None:
        return positive_int(expert_group, "expert_group")  # 'x' was a TypeError from '<'; 2.5 was taken
    return DEFAULT_GROUP_SIZE if device.type == "cuda" else 1


class UpcastBuffer:
    """Reusable host memory for the one weight being computed, grown to the largest module on first need.

    Upcasting into it is a plain copy; a fresh weight-sized tensor per module cost page faults, and with huge pages
    compaction stalls besides (Qwen2.5-7B down projection in a scan: 0.26-0.48 s fresh, 0.011 s reused). Peak
    memory is unchanged: the largest fresh upcast was resident at its module anyway.
    """

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def upcast(self, oriented: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``oriented`` as a contiguous ``dtype`` tensor in this buffer (valid until the next call)."""
        n = oriented.numel()
        if self._storage is None or self._storage.dtype != dtype or self._storage.numel() < n:
            self._storage = None  # the old block goes before the larger one comes
            self._storage = torch.empty(n, dtype=dtype)
        return self._storage[:n].view(oriented.shape).copy_(oriented)


def _compute_weight(
    oriented: torch.Tensor,
    target: TargetModule,
    settings: ScanSettings,
    device: torch.device,
    buffer: UpcastBuffer | None = None,
) -> torch.Tensor:
    """The weight upcast to the compute precision on the device (on CPU into ``buffer`` if given); NaN/Inf refused."""
    dtype = PRECISIONS[settings.precision]
    if buffer is not None and device.type == "cpu":
        weight = buffer.upcast(oriented, dtype)
    else:  # non_blocking: a pinned host tensor (CUDA scans) goes over DMA while this thread queues the next kernels
        weight = oriented.to(device=device, dtype=dtype, non_blocking=True).contiguous()
    # a sum is non-finite if any element is (or on overflow, where the exact check below clears it)
    if not math.isfinite(float(weight.sum())) and not bool(torch.isfinite(weight).all()):
        raise CheckpointError(
            f"{target.tensor.file.name}: tensor '{target.tensor.name}' contains NaN or Inf values; "
            "the checkpoint is corrupt or was saved after a diverged run"
        )
    # Gram entries reach max|w|^2 * max(d_out, d_in): past the dtype's range they overflow and no eigensolver copes
    lo, hi = torch.aminmax(weight) if weight.numel() else (torch.zeros(()), torch.zeros(()))
    largest = max(-float(lo), float(hi))  # one pass, no |W| copy
    if largest * largest * max(weight.shape) > torch.finfo(weight.dtype).max / 16:
        hint = " or scan with --precision float64" if weight.dtype != torch.float64 else ""
        raise CheckpointError(
            f"{target.tensor.file.name}: tensor '{target.tensor.name}' has values up to {largest:.3g}, too large for "
            f"{settings.precision} Gram matrices (they would overflow); check that the checkpoint is not corrupt{hint}"
        )
    # and below the dtype's smallest normal number products underflow: the Gram reads as zero (k = d_in), no energy
    if 0 < largest * largest < 16 * torch.finfo(weight.dtype).tiny:
        hint = (
            " or scan with --precision float64, whose range holds their Gram matrices (the geometry is scale-free)"
            if weight.dtype != torch.float64
            else ""
        )
        raise CheckpointError(
            f"{target.tensor.file.name}: tensor '{target.tensor.name}' has values of at most {largest:.3g}, too small "
            f"for {settings.precision} Gram matrices (their entries would underflow to zero, every input direction "
            f"reading as carrying no energy); check that the checkpoint is not corrupt{hint}"
        )
    return weight


def _scan_module(
    oriented: torch.Tensor,
    target: TargetModule,
    settings: ScanSettings,
    device: torch.device,
    buffer: UpcastBuffer | None = None,
) -> ModuleGeometry:
    """Geometry of one module from its d_out x d_in weight (consumed: freed here)."""
    weight = _compute_weight(oriented, target, settings, device, buffer)
    del oriented
    try:
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
    except (np.linalg.LinAlgError, torch.linalg.LinAlgError) as e:  # numerically hopeless values, e.g. a corrupt file
        raise CheckpointError(
            f"{target.tensor.file.name}: tensor '{target.tensor.name}': the eigensolver failed ({e}); check that the "
            "checkpoint is not corrupt, or scan with --precision float64"
        ) from None
    del weight
    return geo


def _scan_group(
    loaded: list[torch.Tensor], targets: list[TargetModule], settings: ScanSettings, device: torch.device
) -> list[ModuleGeometry]:
    """Geometry of same-shaped experts, solved together (one batched eigensolve)."""
    weights = torch.stack([_compute_weight(w, t, settings, device) for w, t in zip(loaded, targets, strict=True)])
    geos = batched_plate_geometry(
        weights,
        settings.r,
        settings.tau,
        settings.max_rank,
        seeds=[module_seed(settings.seed, t.name) for t in targets],
        n_anchors=settings.anchors,
        sketch_dim=settings.sketch_dim,
        tau_grid=settings.tau_grid,
    )
    del weights
    return geos


def module_outputs(
    target: TargetModule, geo: ModuleGeometry, fingerprint: str, settings: ScanSettings, part: str
) -> tuple[ModuleRecord, dict[str, torch.Tensor]]:
    """A module's manifest record and its bundle tensors (B, Q, redundancy, spectrum) from its geometry."""
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
        # spectral health from the spectrum the scan already has (W_frozen's): free, unlike W's own eigvalsh
        health=health_record(basis.spectrum, (target.shape[0] - int(geo.b_idx.numel()), target.shape[1]), "W_frozen"),
    )
    tensors = {
        f"{target.name}.plate_B_idx": geo.b_idx,
        f"{target.name}.plate_Q": basis.q.to("cpu", Q_DTYPES[settings.q_dtype]),
        f"{target.name}.redundancy": geo.redundancy,
        f"{target.name}.spectrum": basis.spectrum.cpu(),
    }
    record.geometry_digest = geometry_digest(geo.b_idx, tensors[f"{target.name}.plate_Q"])
    record.scores_digest = scores_digest(tensors[f"{target.name}.redundancy"], tensors[f"{target.name}.spectrum"])
    return record, tensors


def _resolve_device(device: str) -> torch.device:
    if not isinstance(device, (str, torch.device)):  # None was a TypeError from torch.device
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r:.80}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f'device="{device}" (CLI: --device {device}) was requested but no CUDA device is available; use '
            'device="cpu" (CLI: --device cpu)'
        )
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")
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


def source_record(ckpt: Checkpoint) -> dict[str, Any]:
    """The manifest's ``source``: a hub repo (id, revision, commit) or a local checkpoint's path."""
    return ckpt.source.to_json() if ckpt.source else {"kind": "local", "id": str(ckpt.root)}


def previous_source(out: str | os.PathLike) -> dict[str, Any] | None:
    """The ``source`` of the bundle already in ``out`` (None: no readable manifest there)."""
    try:
        return json.loads((Path(out) / "manifest.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def same_model(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two manifest sources name the same model (a local path resolved, or a hub repo at any revision); a
    checkpoint file and the directory that holds it name the same model (``dir/model.safetensors`` and ``dir``)."""
    a, b = a or {}, b or {}
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "local":
        pa, pb = (os.path.realpath(str(s.get("id"))) for s in (a, b))
        if os.path.isfile(pa) != os.path.isfile(pb):  # the file's directory against the directory
            pa, pb = (os.path.dirname(p) if os.path.isfile(p) else p for p in (pa, pb))
        return pa == pb
    return a.get("id") == b.get("id")


def default_out_dir(source: str | os.PathLike) -> Path:
    """bundles/<model name> in the working directory, the name taken from the path as the user gave it (a symlink is
    not followed: ``b/model.safetensors`` linked to ``a/model.safetensors`` gives ``bundles/b``): a hub repo's name,
    a local directory's own name, a file's stem, or its directory's name when the stem is the generic ``model``. A
    hub cache snapshot (``models--org--name/snapshots/<commit>``) gives the repo's name."""
    path = Path(str(source)).expanduser()
    if path.is_file() and path.stem not in ("model", ""):
        return Path("bundles") / path.with_suffix("").name
    directory = path.parent if path.is_file() else path
    name = _typed_dir_name(directory)
    return Path("bundles") / (name or "model")


def _typed_dir_name(directory: Path) -> str:
    """A directory's name as written (``linkdir`` stays ``linkdir``); ``.`` and ``..`` are read as the shell reads
    them, from the working directory as it names it (``$PWD``, when it is that directory) and without following
    links (in ``link/sub``, ``..`` is ``link``, as ``cd ..`` and the prompt say, not the link's target); ``/`` is
    ``/``; a hub cache snapshot gives its repo's name."""
    if directory.name in ("", ".."):
        directory = Path(os.path.normpath(_working_dir() / directory))
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.split("--")[-1]
    return directory.name


def _working_dir() -> Path:
    """The working directory by the path the shell entered it (``$PWD``: ``cd linkdir`` gives ``.../linkdir``), or
    the resolved one (``os.getcwd()``) when ``$PWD`` is unset or names another directory (a ``chdir`` since)."""
    logical = os.environ.get("PWD", "")
    try:
        if os.path.isabs(logical) and os.path.samefile(logical, "."):
            return Path(logical)
    except OSError:
        pass
    return Path.cwd()
