"""Check that a bundle is well formed and belongs to a checkpoint's weights (fingerprints of stored bytes)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from plate_inspect.bundle import Bundle, ModuleRecord, geometry_digest
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.progress import ProgressCallback, ProgressCounter
from plate_inspect.targets import EXPERT_LAYOUTS, TargetModule, modules_by_name


@dataclass
class VerifyReport:
    """Per-module problems found; ``ok`` when there are none."""

    bundle: str
    source: str | None
    modules_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    bundle: str | os.PathLike | Bundle,
    source: str | os.PathLike | None = None,
    revision: str | None = None,
    orthonormality_tol: float | None = None,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Validate a bundle's tensors; with ``source``, also check every module's weight fingerprint.

    The manifest's identity must match its settings and fingerprints. Structural checks per module: B indices
    sorted, unique, in range, of length r; Q of shape [d_in, k] with orthonormal columns (max |Q^T Q - I| <= tol,
    by default ``orthonormality_tolerance`` of Q's stored dtype); spectrum descending, >= 0. ``progress`` gets one
    event per module checked.
    """
    b = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
    report = VerifyReport(str(b.path), str(source) if source is not None else None)
    ckpt = Checkpoint.open(source, revision=revision) if source is not None else None
    if b.manifest.identity and b.manifest.identity != b.manifest.content_identity():
        report.problems.append("manifest: identity does not match its settings and module fingerprints (edited?)")
    modules = modules_by_name(ckpt) if ckpt is not None else {}  # 3-D expert slices included
    counter = ProgressCounter(progress, len(b.manifest.modules), "modules")
    counter.start()
    for rec in b:
        report.modules_checked += 1
        _check_module(b, rec, ckpt, modules, orthonormality_tol, report)
        counter.step(rec.name)
    return report


def orthonormality_tolerance(dtype: torch.dtype) -> float:
    """How far max |Q^T Q - I| may be from 0 for a Q stored in ``dtype``: 1e-3, or 4 eps of the dtype if larger.

    Rounding an orthonormal Q entrywise (relative error <= eps/2) moves each entry of Q^T Q by at most
    eps + eps^2/4 (Cauchy-Schwarz over unit columns), so bf16 (eps 2^-7) needs ~3e-2 where float32 Q holds 1e-6.
    """
    return max(1e-3, 4 * torch.finfo(dtype).eps)


def _check_module(
    b: Bundle,
    rec: ModuleRecord,
    ckpt: Checkpoint | None,
    modules: dict[str, TargetModule],
    orthonormality_tol: float | None,
    report: VerifyReport,
) -> None:
    """Append this module's problems (structure; with a checkpoint, its weight fingerprint) to the report."""
    where = f"module '{rec.name}'"
    b_idx, stored_q, spectrum = b.b_idx(rec.name), b.q(rec.name, dtype=None), b.spectrum(rec.name)
    q = stored_q.to(torch.float64)
    tol = orthonormality_tolerance(stored_q.dtype) if orthonormality_tol is None else orthonormality_tol
    if b_idx.numel() != rec.r or (b_idx.numel() and (b_idx.min() < 0 or b_idx.max() >= rec.d_out)):
        report.problems.append(f"{where}: B indices out of range or not r={rec.r} of them")
    elif b_idx.numel() > 1 and not bool((b_idx[1:] > b_idx[:-1]).all()):
        report.problems.append(f"{where}: B indices not strictly ascending")
    if tuple(q.shape) != (rec.d_in, rec.k):
        report.problems.append(f"{where}: Q has shape {list(q.shape)}, manifest says [{rec.d_in}, {rec.k}]")
    else:
        err = float((q.T @ q - torch.eye(rec.k, dtype=q.dtype)).abs().max())
        if err > tol:
            report.problems.append(
                f"{where}: Q columns not orthonormal (max |Q^T Q - I| = {err:.2e} > {tol:.1e} for {stored_q.dtype})"
            )
    if rec.geometry_digest and geometry_digest(b_idx, stored_q) != rec.geometry_digest:
        report.problems.append(
            f"{where}: B or Q differ from what the scan wrote (geometry digest mismatch): the part file "
            f"{rec.file} was edited or is corrupt; rescan with --overwrite"
        )
    if spectrum.numel() and (bool((spectrum < 0).any()) or bool((spectrum[1:] > spectrum[:-1]).any())):
        report.problems.append(f"{where}: spectrum not descending and non-negative")
    if ckpt is not None:
        target = modules.get(rec.name)
        if target is None:
            report.problems.append(f"{where}: the checkpoint has no weight for this module")
            return
        if (
            ckpt.weight_fingerprint(
                target.logical_name, expert=target.expert if target.layout in EXPERT_LAYOUTS else None
            )
            != rec.fingerprint
        ):
            report.problems.append(f"{where}: weight fingerprint differs: the bundle was made for other weights")
