"""The audit's measures: the protected input directions, one module's :class:`AuditRecord`, a model's summary, its
table and notes."""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from plate_inspect.auditing.updates import MXFP4, Delta, delta_row_energy, delta_shape_ok, delta_times
from plate_inspect.errors import ConfigError
from plate_inspect.geometry import (
    energy_rank,
    matmul,
    symmetric_eigh,
)

#: Keys of one ``--json`` record, in order.
AUDIT_KEYS = ("module", "protected_input_share", "frozen_row_share", "delta_norm", "relative_delta")
#: Keys a ``--json`` record adds where TUNED is stored coarser than BASE (bf16 of fp32, FP8, MXFP4): TUNED's storage
#: dtype, and ||round(BASE) - BASE||_F, the storage rounding that was not counted as update.
ROUNDING_KEYS = ("base_rounded_to", "rounding_floor")
#: The key a ``--json`` record adds where BASE is stored coarser than TUNED and TUNED rounded to BASE's storage is
#: BASE exactly (BASE looks like a lower-precision copy of TUNED: the arguments were likely given the other way round).
SWAPPED_KEYS = ("tuned_rounds_to_base",)


# --------------------------------------------------------------------------- the protected input directions
@dataclass
class ProtectedSubspace:
    """Top-m(tau) eigenvectors of W_f^T W_f, or (``complement``) the other d_in - m when that block is smaller."""

    basis: torch.Tensor  # [d_in, j], orthonormal columns
    complement: bool  # True: P = I - basis basis^T
    m: int
    spectrum: torch.Tensor  # eigenvalues of W_f^T W_f, descending, length min(n_frozen, d_in)


def protected_subspace(frozen: torch.Tensor, tau: float) -> ProtectedSubspace:
    """P's range for W_f (n_f x d_in), from the small-side Gram matrix; never d_in x d_in when W_f is wide.

    Tall W_f: eigh of W_f^T W_f; the top m or the bottom d_in - m eigenvectors, whichever block is smaller. Wide
    W_f: eigh of K = W_f W_f^T; the top-m eigenvectors of W_f^T W_f are W_f^T u / sqrt(lambda) for K's top m.
    """
    n_f, d_in = frozen.shape
    if n_f >= d_in:
        evals, evecs = symmetric_eigh(matmul(frozen.T.contiguous(), frozen))
        lam = evals.clamp_min(0)
        spectrum = lam.flip(0)
        m = energy_rank(spectrum, tau)
        if m <= d_in - m:
            return ProtectedSubspace(evecs[:, d_in - m :].contiguous(), False, m, spectrum)
        return ProtectedSubspace(evecs[:, : d_in - m].contiguous(), True, m, spectrum)
    evals, u = symmetric_eigh(matmul(frozen, frozen.T.contiguous()))
    lam = evals.clamp_min(0)
    spectrum = lam.flip(0)
    m = energy_rank(spectrum, tau)
    top, lam_top = u[:, n_f - m :], lam[n_f - m :]
    basis = matmul(frozen.T.contiguous(), top.contiguous()) / lam_top.sqrt()[None, :]
    return ProtectedSubspace(basis.contiguous(), False, m, spectrum)


def protected_energy(delta: Delta, sub: ProtectedSubspace, total: float) -> float:
    """||dW P||_F^2, given total = ||dW||_F^2 (used by the complement form)."""
    if sub.basis.shape[1] == 0:
        return total if sub.complement else 0.0
    inside = float(torch.linalg.vector_norm(delta_times(delta, sub.basis), dtype=torch.float64)) ** 2
    return min(max(total - inside, 0.0), total) if sub.complement else min(inside, total)


# --------------------------------------------------------------------------- one module
@dataclass
class AuditRecord:
    """The audit of one module; ``to_json`` gives :data:`AUDIT_KEYS`, :data:`ROUNDING_KEYS` where BASE was
    rounded to TUNED's coarser storage, and :data:`SWAPPED_KEYS` where BASE is TUNED rounded to BASE's storage."""

    module: str
    protected_input_share: float
    frozen_row_share: float
    delta_norm: float
    relative_delta: float
    shape: tuple[int, int] = (0, 0)  # [d_out, d_in]
    m: int = 0  # m(tau): protected input directions
    r: int = 0  # |B|
    weight_norm: float = 0.0  # ||W||_F
    protected_norm: float = 0.0  # ||dW P||_F
    base_rounded_to: str | None = None  # TUNED's coarser dtype (dW = TUNED - BASE rounded to it), else None
    rounding_floor: float | None = None  # ||round(BASE) - BASE||_F: the storage rounding not counted as update
    tuned_rounds_to_base: str | None = None  # BASE's coarser dtype where round(TUNED) to it == BASE, else None

    @property
    def chance_share(self) -> float:
        """protected_input_share of a dense isotropic random update: m(tau) / d_in."""
        return self.m / self.shape[1] if self.shape[1] else 0.0

    @property
    def risk(self) -> float:
        """||dW P||_F / ||W||_F: the update inside the protected input directions, relative to the weight."""
        return self.protected_norm / self.weight_norm if self.weight_norm > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """One ``--json`` record: the keys named in the class docstring."""
        keys = (
            AUDIT_KEYS
            + (ROUNDING_KEYS if self.base_rounded_to else ())
            + (SWAPPED_KEYS if self.tuned_rounds_to_base else ())
        )
        return {key: getattr(self, key) for key in keys}


def audit_update(name: str, weight: torch.Tensor, delta: Delta, b_idx: torch.Tensor, tau: float) -> AuditRecord:
    """Audit numbers of one module from its base weight (d_out x d_in), its update and B. Pure; inputs untouched.

    An all-zero update scores 0 on both shares (nothing reached the protected directions or the frozen rows).
    """
    d_out, d_in = weight.shape
    if not delta_shape_ok(delta, d_out, d_in):
        raise ConfigError(f"module '{name}': the update does not fit the base weight [d_out, d_in] = [{d_out}, {d_in}]")
    weight_norm = float(torch.linalg.vector_norm(weight, dtype=torch.float64))
    row_energy = delta_row_energy(delta, d_out)
    total = float(row_energy.sum())
    in_b = torch.zeros(d_out, dtype=torch.bool)
    in_b[b_idx.cpu()] = True
    frozen_energy = float(row_energy[~in_b].sum())
    sub = protected_subspace(weight[torch.nonzero(~in_b).flatten().to(weight.device)], tau)
    prot = protected_energy(delta, sub, total) if total > 0 else 0.0
    delta_norm = math.sqrt(total)
    return AuditRecord(
        module=name,
        protected_input_share=prot / total if total > 0 else 0.0,
        frozen_row_share=frozen_energy / total if total > 0 else 0.0,
        delta_norm=delta_norm,
        relative_delta=delta_norm / weight_norm if weight_norm > 0 else 0.0,
        shape=(d_out, d_in),
        m=sub.m,
        r=int(b_idx.numel()),
        weight_norm=weight_norm,
        protected_norm=math.sqrt(prot),
    )


# --------------------------------------------------------------------------- model level
@dataclass
class AuditSummary:
    """Model-level aggregates (energy-weighted over modules)."""

    modules: int
    touched: int  # modules with a nonzero update
    protected_input_share: float  # sum ||dW P||^2 / sum ||dW||^2
    frozen_row_share: float
    relative_delta: float  # sqrt(sum ||dW||^2 / sum ||W||^2)
    risk: float  # sqrt(sum ||dW P||^2 / sum ||W||^2): the model-level score


def summarize(records: list[AuditRecord]) -> AuditSummary:
    """Energy-weighted model-level shares and the model risk sqrt(sum ||dW P||^2 / sum ||W||^2)."""
    delta_sq = sum(r.delta_norm**2 for r in records)
    weight_sq = sum(r.weight_norm**2 for r in records)
    prot_sq = sum(r.protected_norm**2 for r in records)
    frozen_sq = sum(r.frozen_row_share * r.delta_norm**2 for r in records)
    return AuditSummary(
        modules=len(records),
        touched=sum(1 for r in records if r.delta_norm > 0),
        protected_input_share=prot_sq / delta_sq if delta_sq > 0 else 0.0,
        frozen_row_share=frozen_sq / delta_sq if delta_sq > 0 else 0.0,
        relative_delta=math.sqrt(delta_sq / weight_sq) if weight_sq > 0 else 0.0,
        risk=math.sqrt(prot_sq / weight_sq) if weight_sq > 0 else 0.0,
    )


#: Columns of the ranked audit table (CLI and HTML report alike).
TABLE_COLUMNS = (
    "module",
    "d_out x d_in",
    "|B|",
    "protected",
    "chance",
    "frozen rows",
    "||dW||",
    "||dW||/||W||",
    "risk",
)


def table_cells(rec: AuditRecord) -> tuple[str, ...]:
    """One record's cells of the ranked audit table, formatted, in :data:`TABLE_COLUMNS` order."""
    changed = rec.delta_norm > 0  # an unchanged module has no share ('-'), not 0 (which reads as PLATE's form)
    return (
        rec.module,
        f"{rec.shape[0]}x{rec.shape[1]}",
        str(rec.r),
        f"{rec.protected_input_share:.4f}" if changed else "-",
        f"{rec.chance_share:.4f}",
        f"{rec.frozen_row_share:.4f}" if changed else "-",
        f"{rec.delta_norm:.3e}",
        f"{rec.relative_delta:.3e}",
        f"{rec.risk:.3e}",
    )


def _quantized_kinds(dtypes: Iterable[str]) -> list[str]:
    """'FP8' and/or 'MXFP4' among TUNED's coarser storage labels (the scaled formats), in that order."""
    kinds = {"FP8" if d.startswith("float8") else "MXFP4" if d == MXFP4 else "" for d in dtypes}
    return sorted(kinds - {""})


def rounding_kind(records: list[AuditRecord]) -> str | None:
    """'FP8 quantization error', 'MXFP4 quantization error' or 'bfloat16 rounding' (TUNED's coarser storage
    dtypes) where BASE was rounded to TUNED's storage in some module; None where it was not."""
    dtypes = sorted({rec.base_rounded_to for rec in records if rec.base_rounded_to})
    if not dtypes:
        return None
    kinds = _quantized_kinds(dtypes)
    return f"{'/'.join(kinds)} quantization error" if kinds else f"{'/'.join(dtypes)} rounding"


def rounding_note(records: list[AuditRecord]) -> str | None:
    """The note (CLI and HTML report) for modules whose BASE was rounded to TUNED's coarser storage, else None."""
    rounded = [rec for rec in records if rec.base_rounded_to]
    if not rounded:
        return None
    dtypes = sorted({rec.base_rounded_to for rec in rounded if rec.base_rounded_to})
    floors = ((rec.rounding_floor or 0.0) / rec.weight_norm for rec in rounded if rec.weight_norm > 0)
    worst = max(floors, default=0.0)
    count = f"{len(rounded)} module{'s' if len(rounded) != 1 else ''}"
    return (
        f"TUNED stores {count} in {'/'.join(dtypes)}, which does not hold BASE's values exactly: dW = TUNED - BASE "
        "rounded to that dtype"
        + (f" (at TUNED's own {'/'.join(kinds)} scales)" if (kinds := _quantized_kinds(dtypes)) else "")
        + f", so the storage rounding alone is not an update ({rounding_kind(records)}: ||round(BASE) - BASE||/||W|| "
        f"up to {worst:.2e}; JSON: base_rounded_to, rounding_floor)"
    )


def swapped_note(records: list[AuditRecord]) -> str | None:
    """The note (CLI and HTML report) for modules whose BASE is exactly TUNED rounded to BASE's coarser storage: such
    a BASE is a lower-precision copy of TUNED, so BASE and TUNED were most likely given the other way round."""
    swapped = [rec for rec in records if rec.tuned_rounds_to_base]
    if not swapped:
        return None
    dtypes = "/".join(sorted({rec.tuned_rounds_to_base for rec in swapped if rec.tuned_rounds_to_base}))
    count = f"{len(swapped)} of {len(records)} module{'s' if len(records) != 1 else ''}"
    return (
        f"in {count} BASE is exactly TUNED rounded to BASE's {dtypes}: BASE looks like a lower-precision copy of "
        "TUNED, and the 'update' is TUNED's extra precision; were BASE and TUNED swapped? (audit BASE TUNED: the "
        f"model that was fine-tuned first; JSON: {SWAPPED_KEYS[0]})"
    )


def audit_notes(records: list[AuditRecord]) -> list[str]:
    """The notes an audit's output carries after its summary (CLI and HTML report alike), in order: BASE rounded to
    TUNED's storage, then BASE and TUNED likely swapped; none where neither applies."""
    return [note for note in (rounding_note(records), swapped_note(records)) if note]


def rank_by_risk(records: list[AuditRecord]) -> list[AuditRecord]:
    """Records ordered by risk, highest first (ties: larger protected share, then name)."""
    return sorted(records, key=lambda r: (-r.risk, -r.protected_input_share, r.module))
