"""Check that a bundle is well formed and belongs to a checkpoint's weights (fingerprints of stored bytes); on
request, that every Q is the exact bottom-k eigenspace of those weights (a float64 dense oracle)."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from plate_inspect.arguments import path_argument
from plate_inspect.bundle import Bundle, ModuleRecord, damaged, part_records, stored_b_problem
from plate_inspect.checkpoint import INDEX_FILE, Checkpoint, refuse_adapter
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.geometry import exactness_allowance
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import EXPERT_LAYOUTS, TargetModule, load_target, modules_by_name


@dataclass(frozen=True)
class ExactnessCheck:
    """One module's Q against the float64 dense oracle on its weights: energies are tr(Q^T G Q), G = W_f^T W_f."""

    energy: float  # of the stored Q
    optimum: float  # the k smallest eigenvalues of G, summed
    allowance: float  # exactness_allowance(optimum, tr(G))
    rounding: float  # what storing Q in its dtype may add to sqrt(energy)

    @property
    def ok(self) -> bool:
        """Q is exact: sqrt(energy) within sqrt(optimum + allowance), plus what rounding Q to its dtype may add."""
        return math.sqrt(max(self.energy, 0.0)) <= math.sqrt(self.optimum + self.allowance) + self.rounding

    @property
    def used(self) -> float:
        """(energy - optimum) / allowance: the share of the exactness allowance Q uses (<= 1: exact)."""
        return (self.energy - self.optimum) / self.allowance if self.allowance > 0 else 0.0


def check_exactness(weight: torch.Tensor, b_idx: torch.Tensor, q: torch.Tensor) -> ExactnessCheck:
    """Q's energy on W_f (``weight`` without the B rows, d_out x d_in) against the optimum, all in float64.

    The optimum is the sum of the k smallest eigenvalues of G = W_f^T W_f (eigvalsh of the smaller of G and
    W_f W_f^T, with the null space's zeros). A Q stored in a narrow dtype is the exact one rounded entrywise
    (|E| <= u |Q|, ||E||_F <= u sqrt(k)), which may add up to ||W_f||_2 u sqrt(k) to sqrt(energy).
    """
    if weight.ndim != 2 or q.ndim != 2 or q.shape[0] != weight.shape[1] or not q.is_floating_point():
        raise ValueError(
            f"check_exactness needs weight [d_out, d_in] and a floating q [d_in, k], got {list(weight.shape)} and "
            f"{q.dtype} {list(q.shape)}"
        )
    if b_idx.numel() and (int(b_idx.min()) < 0 or int(b_idx.max()) >= weight.shape[0]):
        lo, hi = int(b_idx.min()), int(b_idx.max())
        raise ValueError(f"b_idx must index weight's {weight.shape[0]} rows, got indices in [{lo}, {hi}]")
    w = weight.detach().to("cpu", torch.float64)
    keep = torch.ones(w.shape[0], dtype=torch.bool)
    keep[b_idx.to(torch.long)] = False
    wf = w[keep]
    n_f, d_in = wf.shape
    k = q.shape[1]
    total = float((wf * wf).sum())
    energy = float((wf @ q.detach().to("cpu", torch.float64)).square().sum())
    small = wf @ wf.T if n_f < d_in else wf.T @ wf
    values = torch.linalg.eigvalsh(small).clamp_min(0)  # ascending
    zeros = max(0, d_in - n_f)  # G's null space beyond the small side's eigenvalues
    optimum = float(values[: max(0, k - zeros)].sum())
    u = torch.finfo(q.dtype).eps / 2
    rounding = math.sqrt(float(values[-1])) * u * math.sqrt(k) if values.numel() else 0.0
    return ExactnessCheck(energy, optimum, exactness_allowance(optimum, total), rounding)


@dataclass
class VerifyReport:
    """Per-module problems found; ``ok`` when there are none."""

    bundle: str
    source: str | None
    modules_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # worth knowing, not a failure (another model_type, ...)
    exactness: dict[str, ExactnessCheck] = field(default_factory=dict)  # verify(..., exact=True)
    changed: list[str] = field(default_factory=list)  # modules whose weight's fingerprint differs (a fine-tune?)
    absent: list[str] = field(default_factory=list)  # modules the checkpoint has no weight for (another model?)

    @property
    def ok(self) -> bool:
        """No problem found (notes do not count)."""
        return not self.problems

    def __repr__(self) -> str:
        """A line of counts, then the first :data:`_REPR_PROBLEMS` problems (each cut to :data:`_REPR_WIDTH`
        characters): a damaged or changed 15k-module bundle has a problem per module, which the dataclass repr
        printed all of."""
        counts = ", ".join(
            f"{what}={len(getattr(self, what))}" for what in ("problems", "notes", "changed", "absent", "exactness")
        )
        lines = [
            f"VerifyReport({self.bundle!r}, source={self.source!r}, ok={self.ok}, "
            f"modules_checked={self.modules_checked}, {counts})"
        ]
        lines += [f"  problem: {_cut(p)}" for p in self.problems[:_REPR_PROBLEMS]]
        if len(self.problems) > _REPR_PROBLEMS:
            lines.append(f"  ... {len(self.problems) - _REPR_PROBLEMS} more in .problems")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (``plate-inspect verify --json``): every field, ``ok``, and per module of
        an exactness check its energies, ``used`` (share of the allowance) and ``ok``."""
        exactness = {
            name: {**asdict(check), "used": check.used, "ok": check.ok} for name, check in self.exactness.items()
        }
        return {**asdict(self), "exactness": exactness, "ok": self.ok}


#: How many problems, and how many characters of each, a VerifyReport's repr shows.
_REPR_PROBLEMS, _REPR_WIDTH = 3, 200


def _cut(text: str) -> str:
    """``text`` cut to :data:`_REPR_WIDTH` characters, with '…' where it was cut."""
    return text if len(text) <= _REPR_WIDTH else text[: _REPR_WIDTH - 1] + "…"


def verify(
    bundle: str | os.PathLike | Bundle,
    source: str | os.PathLike | None = None,
    revision: str | None = None,
    orthonormality_tol: float | None = None,
    progress: ProgressCallback | None = None,
    exact: bool = False,
) -> VerifyReport:
    """Validate a bundle's tensors; with ``source``, also check every module's weight fingerprint.

    The manifest's identity must match its settings and fingerprints. Structural checks per module: B indices
    sorted, unique, in range, of length r; Q of shape [d_in, k] with orthonormal columns (max |Q^T Q - I| <= tol,
    by default ``orthonormality_tolerance`` of Q's stored dtype); spectrum descending, >= 0. ``progress`` gets one
    event per module checked. ``exact`` (needs ``source``) also checks every Q against the float64 dense oracle on
    the checkpoint's weights (``check_exactness``; minutes for a 7B model): ``report.exactness`` holds the figures.
    Ablation bundles' Q's are not bottom-k by design and are skipped. A ``source`` that is an adapter (PLATE, PEFT,
    LoRA) is refused with a ``CheckpointError`` naming its base model.
    """
    if exact and source is None:
        raise ConfigError(
            "exact=True (CLI: --exact) needs source (CLI: MODEL): the oracle is computed from the model's weights"
        )
    if orthonormality_tol is not None and not (
        isinstance(orthonormality_tol, numbers.Real)
        and not isinstance(orthonormality_tol, bool)
        and 0 <= orthonormality_tol < math.inf
    ):
        raise ConfigError(f"orthonormality_tol must be a finite number >= 0 or None, got {orthonormality_tol!r:.80}")
    b = bundle if isinstance(bundle, Bundle) else Bundle.load(path_argument(bundle, "bundle"))
    report = VerifyReport(str(b.path), str(source) if source is not None else None)
    ckpt = Checkpoint.open(source, revision=revision) if source is not None else None
    if ckpt is not None:
        refuse_adapter(ckpt, use="verify the bundle against")  # not 'no weight' for every module
    if b.manifest.identity and b.manifest.identity != b.manifest.content_identity():
        report.problems.append("manifest: identity does not match its settings and module fingerprints (edited?)")
    modules = modules_by_name(ckpt) if ckpt is not None else {}  # 3-D expert slices included
    if ckpt is not None:
        theirs, ours = ckpt.config.get("model_type"), b.manifest.model_type
        if theirs and ours and theirs != ours:
            report.notes.append(
                f"the checkpoint's model_type is '{theirs}', the bundle was scanned from a '{ours}' model: the "
                "fingerprint checks decide whether its weights are the same; a trainer applies the bundle by "
                "module name, so check that the names mean the same layers in both"
            )
    counter = ProgressCounter(as_callback(progress, "verify"), len(b.manifest.modules), "modules")
    counter.start()
    headers: dict[str, dict[str, ModuleRecord]] = {}  # part file -> the records its header vouches for, once read
    for rec in b:
        report.modules_checked += 1
        try:
            _check_module(b, rec, ckpt, modules, orthonormality_tol, report, exact, headers)
        except BundleError as e:  # a missing or truncated part file: reported per module, the rest still checked
            report.problems.append(str(e))
        counter.step(rec.name)
    if ckpt is not None:
        report.notes.extend(_diagnosis(report, str(source)))
    return report


def _diagnosis(report: VerifyReport, source: str) -> list[str]:
    """One line on what the weight problems mean together: another model, or changed weights of this one."""
    n = report.modules_checked
    shard = Path(source).is_file() and (Path(source).parent / INDEX_FILE).is_file()
    if report.absent and shard:
        return [
            f"{source} is one shard of a sharded model ({len(report.absent)} of the bundle's {n} modules have no "
            f"weight in it): verify against the model's directory, {Path(source).parent}"
        ]
    if report.absent and len(report.absent) == n:
        return [
            f"{source} has a weight for none of the bundle's {n} modules: the bundle was made for another model "
            "(or another architecture); verify it against that model, or scan this one"
        ]
    if report.changed:
        what = "all" if len(report.changed) == n else f"{len(report.changed)} of"
        return [
            f"{what} {n} modules' weights differ from the ones the bundle was scanned from (a fine-tune, a merge or "
            f"another revision of the model: the modules named above); for a bundle of these weights, scan {source} "
            "into a new directory, or into this bundle's (that recomputes just the changed modules)"
        ]
    return []


def _header_fingerprint(b: Bundle, rec: ModuleRecord, headers: dict[str, dict[str, ModuleRecord]]) -> str | None:
    """The weight fingerprint a module's part file header records (what a rescan checks weights against), if it
    vouches for the module with the bundle's settings; read only where the manifest's fingerprint did not match,
    once per part file (``headers``: those read so far; a fine-tune changes every module, ~750 to a part)."""
    if rec.file not in headers:
        headers[rec.file] = part_records(b.path / rec.file, b.settings, b.manifest.variant)
    header = headers[rec.file].get(rec.name)
    return header.fingerprint if header is not None else None


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
    exact: bool,
    headers: dict[str, dict[str, ModuleRecord]],
) -> None:
    """Append this module's problems (structure; with a checkpoint, its weight fingerprint) to the report;
    ``headers``: the part headers read so far (:func:`_header_fingerprint`)."""
    where = f"module '{rec.name}'"
    b_idx, stored_q, spectrum = b.b_idx(rec.name), b.q(rec.name, dtype=None), b.spectrum(rec.name)
    q = stored_q.to(torch.float64)
    tol = orthonormality_tolerance(stored_q.dtype) if orthonormality_tol is None else orthonormality_tol
    b_problem = stored_b_problem(rec, b_idx)  # the reader's check of stored B: count, range, order
    if b_problem:
        report.problems.append(f"{where}: {b_problem}")
    if tuple(q.shape) != (rec.d_in, rec.k):
        report.problems.append(f"{where}: Q has shape {list(q.shape)}, manifest says [{rec.d_in}, {rec.k}]")
    else:
        err = float((q.T @ q - torch.eye(rec.k, dtype=q.dtype)).abs().max())
        if err > tol:
            report.problems.append(
                f"{where}: Q columns not orthonormal (max |Q^T Q - I| = {err:.2e} > {tol:.1e} for {stored_q.dtype})"
            )
    what = damaged(rec, {"plate_B_idx": b_idx, "plate_Q": stored_q, "redundancy": b.redundancy(rec.name),
                         "spectrum": spectrum})  # fmt: skip
    if what:
        report.problems.append(
            f"{where}: {what} differ from what the scan wrote (digest mismatch): the part file {rec.file} was "
            "edited or is corrupt; rescan (damaged modules are recomputed)"
        )
    if spectrum.numel() and (bool((spectrum < 0).any()) or bool((spectrum[1:] > spectrum[:-1]).any())):
        report.problems.append(f"{where}: spectrum not descending and non-negative")
    if ckpt is not None:
        target = modules.get(rec.name)
        if target is None:
            report.problems.append(f"{where}: the checkpoint has no weight for this module")
            report.absent.append(rec.name)
            return
        if list(target.shape) != list(rec.shape) or target.layout != rec.layout:
            report.problems.append(
                f"{where}: the checkpoint's weight is [d_out, d_in] = {list(target.shape)} ({target.layout}), the "
                f"bundle's record says {list(rec.shape)} ({rec.layout}): scanned with another config.json (e.g. "
                "without its model_type) or from another model; rescan"
            )
            return
        check_q = exact and rec.variant is None and not b_problem and rec.k > 0 and tuple(q.shape) == (rec.d_in, rec.k)
        if check_q:
            weight, fingerprint = load_target(ckpt, target)
        else:
            expert = target.expert if target.layout in EXPERT_LAYOUTS else None
            weight, fingerprint = None, ckpt.weight_fingerprint(target.logical_name, expert=expert)
        if fingerprint != rec.fingerprint and _header_fingerprint(b, rec, headers) == fingerprint:
            report.problems.append(
                f"{where}: manifest.json records another weight fingerprint than its part file {rec.file}, whose "
                "record matches the checkpoint's weight: the manifest was edited; rescan the model into the bundle "
                "(nothing is recomputed, the manifest is rewritten from the part files)"
            )
        elif fingerprint != rec.fingerprint:
            report.problems.append(f"{where}: weight fingerprint differs: the bundle was made for other weights")
            report.changed.append(rec.name)
        elif weight is not None:
            check = check_exactness(weight, b_idx, stored_q)
            report.exactness[rec.name] = check
            if not check.ok:
                report.problems.append(
                    f"{where}: Q is not the bottom-{rec.k} eigenspace of these weights: energy {check.energy:.4e} "
                    f"vs the optimum {check.optimum:.4e} (allowance {check.allowance:.2e}; float64 dense oracle)"
                )
