"""Audit any fine-tune from the weights alone: how much of each update lands where the frozen rows live.

For a module with base weight W (d_out x d_in), update dW (tuned minus base), B the redundant output rows (the
bundle's, or chosen exactly as the scan chooses them) and W_f the rows outside B:

- ``protected_input_share`` = ||dW P||_F^2 / ||dW||_F^2, P the projector onto the top-m(tau) eigenvectors of
  W_f^T W_f: the input directions holding a tau fraction of the frozen rows' energy;
- ``frozen_row_share`` = the share of ||dW||_F^2 on rows outside B;
- ``delta_norm`` = ||dW||_F and ``relative_delta`` = ||dW||_F / ||W||_F.

A fine-tuned checkpoint stored coarser than BASE (bf16 of an fp32 base; FP8 with block scales or MXFP4 of a bf16/fp32
base) gives dW = TUNED - BASE rounded to TUNED's storage (:func:`rounding_reference`; FP8 and MXFP4 at TUNED's own
scales): the
rounding or quantization of the save is not an update. Records say so (``base_rounded_to``, ``rounding_floor``).

A PLATE update (rows in B, inputs in the bottom eigenspace Q) scores 0 on both; a dense isotropic random update
scores m(tau)/d_in on the first and (d_out - r)/d_out on the second. Per-module ``risk`` = ||dW P||_F / ||W||_F
(the update's size inside the protected directions, relative to the weight) ranks modules.

TUNED is a fine-tuned checkpoint (dir, ``.safetensors`` file or hub id), a PEFT LoRA adapter dir
(dW = (alpha/r) B A, rsLoRA alpha/sqrt(r), ``rank_pattern``/``alpha_pattern`` honoured), or a PLATE adapter
(a ``save_adapter`` file, a dir holding one, or a PEFT ``plate`` adapter dir: dW = rho B A Q^T on B's rows).
Streaming: one module's weights are in memory at a time; low-rank updates are never formed densely.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from plate_inspect.atomic import path_argument
from plate_inspect.bundle import Bundle, ScanSettings
from plate_inspect.checkpoint import (
    Checkpoint,
    parse_safetensors_header,
)
from plate_inspect.dtypes import DTYPES, PRECISIONS
from plate_inspect.errors import BundleError, CheckpointError, ConfigError
from plate_inspect.geometry import (
    check_sketch_dim,
    effective_r,
    energy_rank,
    matmul,
    module_seed,
    redundancy_scores,
    select_redundant_rows,
    symmetric_eigh,
)
from plate_inspect.progress import ProgressCallback, ProgressCounter, as_callback
from plate_inspect.targets import (
    CONV1D_FAMILIES,
    EXPERT_LAYOUTS,
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

#: Keys of one ``--json`` record, in order.
AUDIT_KEYS = ("module", "protected_input_share", "frozen_row_share", "delta_norm", "relative_delta")
#: Keys a ``--json`` record adds where TUNED is stored coarser than BASE (bf16 of fp32, FP8, MXFP4): TUNED's storage
#: dtype, and ||round(BASE) - BASE||_F, the storage rounding that was not counted as update.
ROUNDING_KEYS = ("base_rounded_to", "rounding_floor")
#: The key a ``--json`` record adds where BASE is stored coarser than TUNED and TUNED rounded to BASE's storage is
#: BASE exactly (BASE looks like a lower-precision copy of TUNED: the arguments were likely given the other way round).
SWAPPED_KEYS = ("tuned_rounds_to_base",)
#: The storage (and ``base_rounded_to``) of an MXFP4 TUNED weight (gpt-oss's experts): E2M1 elements times E8M0
#: power-of-two scales per 32-element block, a grid no torch dtype rounds to (:func:`round_e2m1`).
MXFP4 = "mxfp4"
#: E2M1's grid (OCP MX v1.0, section 5.3.3): values 0, 0.5, 1, 1.5, 2, 3, 4, 6; eps (step / 2^binade) and smallest
#: normal, as torch.finfo gives them for the float dtypes.
_E2M1_EPS, _E2M1_NORMAL, _E2M1_MAX = 0.5, 1.0, 6.0
#: |value / scale| up to which MXFP4 saturates to +-6: OCP's block scale 2^(floor(log2 amax) - 2) puts every block's
#: amax below 8 x scale. Beyond, no save at that scale could have produced the value: BASE is kept there.
_E2M1_SATURATES_BELOW = 8.0
#: A coarser storage TUNED may hold: a torch floating dtype (bf16, FP8) or :data:`MXFP4`.
Storage = Union[torch.dtype, str]  # noqa: UP007 (a runtime alias)
_PEFT_PREFIX = "base_model.model."


# --------------------------------------------------------------------------- updates
@dataclass(frozen=True)
class LowRankDelta:
    """dW = left @ right placed on output rows ``rows`` (all rows in order when None); never formed densely."""

    left: torch.Tensor  # [n, q]
    right: torch.Tensor  # [q, d_in]
    rows: torch.Tensor | None = None  # int64 [n]


Delta = Union[torch.Tensor, LowRankDelta]  # noqa: UP007 (a runtime alias; X | Y needs Python 3.10 classes)


def delta_shape_ok(delta: Delta, d_out: int, d_in: int) -> bool:
    """True when the update fits a d_out x d_in weight."""
    if isinstance(delta, torch.Tensor):
        return tuple(delta.shape) == (d_out, d_in)
    n = delta.left.shape[0]
    rows_ok = (
        n == d_out if delta.rows is None else (delta.rows.numel() == n and (n == 0 or int(delta.rows.max()) < d_out))
    )
    return rows_ok and delta.right.shape[1] == d_in and delta.left.shape[1] == delta.right.shape[0]


def delta_row_energy(delta: Delta, d_out: int) -> torch.Tensor:
    """||dW_i||^2 for every output row i, float64 [d_out]."""
    if isinstance(delta, torch.Tensor):
        return torch.linalg.vector_norm(delta, dim=1, dtype=torch.float64) ** 2
    gram = matmul(delta.right, delta.right.T.contiguous())
    energy = (matmul(delta.left, gram) * delta.left).sum(dim=1).double().clamp_min(0)
    if delta.rows is None:
        return energy
    out = torch.zeros(d_out, dtype=torch.float64)
    out[delta.rows] = energy
    return out


def delta_times(delta: Delta, v: torch.Tensor) -> torch.Tensor:
    """dW V restricted to dW's nonzero rows (enough for Frobenius norms)."""
    if isinstance(delta, torch.Tensor):
        return matmul(delta, v)
    return matmul(delta.left, matmul(delta.right, v).contiguous())


def _grid(storage: Storage) -> tuple[float, float]:
    """eps and smallest normal of ``storage``'s floating grid (float dtypes: torch.finfo; MXFP4: E2M1's)."""
    if isinstance(storage, str):  # MXFP4, the one storage that is not a torch dtype
        return _E2M1_EPS, _E2M1_NORMAL
    info = torch.finfo(storage)
    return info.eps, info.smallest_normal


def grid_step(values: torch.Tensor, dtype: Storage) -> torch.Tensor:
    """The spacing of ``dtype``'s floating grid at |values| (float32 units, unscaled): eps * 2^floor(log2 |v|),
    the subnormal spacing below the smallest normal (e4m3: 2^-3 per binade, 2^-9 below 2^-6; MXFP4's E2M1: 0.5
    below 2, 1 in [2, 4), 2 from 4)."""
    eps, normal = _grid(dtype)
    _, exponent = torch.frexp(values.abs().clamp_min(normal))  # |v| = m 2^e, m in [0.5, 1)
    return eps * torch.ldexp(torch.ones_like(values), exponent - 1)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed), ties to the even code,
    saturating at +-6: MXFP4's element rounding (OCP MX v1.0). Exact: the steps are powers of two."""
    step = grid_step(x, MXFP4)
    return (torch.round(x / step) * step).clamp(-_E2M1_MAX, _E2M1_MAX)  # torch.round: half to even


def _coarser(weight: torch.Tensor, dtype: Storage, scale: torch.Tensor | None) -> bool:
    """Whether storing ``weight`` in ``dtype`` (FP8: with a ``scale``; MXFP4 always has one) can round it."""
    if isinstance(dtype, str):  # MXFP4 (always with a scale)
        return True
    if not dtype.is_floating_point:
        return False
    return scale is not None or torch.finfo(dtype).eps > torch.finfo(weight.dtype).eps


def rounded_like(weight: torch.Tensor, dtype: Storage, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` rounded as a coarser floating storage ``dtype`` stores it, and back; ``weight`` itself when
    ``dtype`` is not coarser. bf16/f16: a cast. FP8 with ``scale`` (the per-element dequantization scale,
    ``scale_inv``): round(weight / scale) to FP8, times scale, rounded to float32 as the checkpoint reader forms it.
    A value beyond ``dtype``'s range at that scale keeps ``weight``'s (no save of it could have produced it).
    :data:`MXFP4` with ``scale`` (each element's 2^(e8m0 - 127)): :func:`round_e2m1` of weight / scale, times scale;
    values saturate to +-6 x scale up to 8 x scale, beyond which ``weight``'s value is kept."""
    if not _coarser(weight, dtype, scale):
        return weight
    if isinstance(dtype, str):  # MXFP4
        if scale is None:
            raise ValueError("MXFP4 rounding needs the per-element block scale")
        work = torch.float64 if weight.dtype == torch.float64 else torch.float32  # / and x scale: powers of two, exact
        x = weight.to(work) / scale.to(work)
        rounded = (round_e2m1(x) * scale.to(work)).to(torch.float32).to(weight.dtype)
        return torch.where(x.abs() < _E2M1_SATURATES_BELOW, rounded, weight)
    if scale is None:
        x, rounded = weight, weight.to(dtype).to(weight.dtype)
    else:
        work = torch.float64 if scale.dtype == torch.float64 else torch.float32
        x = weight.to(work) / scale.to(work)
        rounded = (x.to(dtype).to(work) * scale.to(work)).to(torch.float32).to(weight.dtype)
    return torch.where(x.abs() <= torch.finfo(dtype).max, rounded, weight)


def rounding_reference(
    base: torch.Tensor, tuned: torch.Tensor, dtype: Storage, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What TUNED holds where it is BASE saved in ``dtype`` (FP8, MXFP4: at TUNED's own ``scale``): BASE rounded to that
    grid, and TUNED itself wherever it lies within half a grid step of BASE (a tie rounded the other way, a
    quantizer that multiplies by 1/scale): a difference within the storage's rounding half-step is rounding, not
    an update (MXFP4: E2M1's step at that magnitude times the block scale). ``base`` itself when ``dtype`` is not
    coarser. ``tuned`` in ``base``'s dtype and orientation."""
    rounded = rounded_like(base, dtype, scale)
    if rounded is base:
        return base
    unit = torch.ones((), dtype=base.dtype) if scale is None else scale.to(base.dtype)
    magnitude = torch.minimum((tuned / unit).abs(), (base / unit).abs())  # the finer side of a binade edge
    # slack: float32 division vs 1/scale products; none for MXFP4, whose power-of-two scales divide exactly
    half = 0.5 * grid_step(magnitude, dtype) * unit * (1 if dtype == MXFP4 else 1 + 2**-12)
    return torch.where((tuned - base).abs() <= half, tuned, rounded)


def fp8_storage(ckpt: Checkpoint, target: TargetModule) -> tuple[torch.dtype, torch.Tensor | None] | None:
    """A module's FP8 storage in ``ckpt``: its FP8 dtype and per-element dequantization scale oriented d_out x d_in
    (None for a plain cast without scales); None when the module is not stored in FP8. Reads the scales only
    (one expert's block scales for a 3-D stack), which :meth:`Checkpoint.read_weight` has already checked."""
    weight = ckpt.logical_weight(target.logical_name)
    dtype = DTYPES[weight.stored_dtype].torch
    if weight.format != "fp8" or dtype is None:
        return None
    expert = target.expert if target.layout in EXPERT_LAYOUTS else None
    scale = ckpt.fp8_scale(target.logical_name, expert)
    if scale is not None and scale.ndim == 2 and target.layout in ("conv1d", "experts_in_major"):
        scale = scale.T
    return dtype, scale


def mxfp4_storage(ckpt: Checkpoint, target: TargetModule) -> torch.Tensor | None:
    """A module's MXFP4 per-element scale (:meth:`Checkpoint.mxfp4_scale`) oriented d_out x d_in; None when the
    module is not stored in MXFP4. A NaN scale code gives NaN, which the delta's finiteness check reports."""
    if ckpt.logical_weight(target.logical_name).format != "mxfp4":
        return None
    expert = target.expert if target.layout in EXPERT_LAYOUTS else None
    scale = ckpt.mxfp4_scale(target.logical_name, expert)
    return scale.T if target.layout in ("conv1d", "experts_in_major") else scale


def quantized_storage(ckpt: Checkpoint, target: TargetModule) -> tuple[Storage, torch.Tensor | None] | None:
    """A module's quantized storage in ``ckpt`` (FP8: :func:`fp8_storage`; MXFP4: :data:`MXFP4` and
    :func:`mxfp4_storage`'s scale), None for a plain floating dtype."""
    scale = mxfp4_storage(ckpt, target)
    return (MXFP4, scale) if scale is not None else fp8_storage(ckpt, target)


def storage_label(storage: Storage) -> str:
    """``base_rounded_to``'s spelling of a storage: the torch dtype's name ('bfloat16', 'float8_e4m3fn') or 'mxfp4'."""
    return storage if isinstance(storage, str) else str(storage).removeprefix("torch.")


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


def rank_by_risk(records: list[AuditRecord]) -> list[AuditRecord]:
    """Records ordered by risk, highest first (ties: larger protected share, then name)."""
    return sorted(records, key=lambda r: (-r.risk, -r.protected_input_share, r.module))


# --------------------------------------------------------------------------- where the update comes from
def resolve_names(wanted: list[str], available: list[str], what: str) -> dict[str, str]:
    """Map adapter module names onto checkpoint module names: exact, else the unique suffix match either way."""
    have = set(available)
    out: dict[str, str] = {}
    for name in wanted:
        if name in have:
            out[name] = name
            continue
        cands = _suffix_match(name, available)
        if len(cands) != 1:
            why = "no module" if not cands else f"{len(cands)} modules ({', '.join(cands[:3])})"
            raise CheckpointError(f"{what}: module '{name}' matches {why} of the base checkpoint")
        out[name] = cands[0]
    return out


def _suffix_match(name: str, available: list[str]) -> list[str]:
    """The modules of ``available`` that ``name`` is a dotted suffix of, else those that are a dotted suffix of it."""
    return [a for a in available if a.endswith("." + name)] or [a for a in available if name.endswith("." + a)]


def _match_pattern(patterns: dict[str, Any], key: str) -> str | None:
    """PEFT's rank_pattern/alpha_pattern lookup: the first pattern p with re.match('(.*\\.)?(p)$', key)."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return None


class UpdateSource:
    """Where dW comes from. ``modules``: base-checkpoint module names it touches (None: every target)."""

    bundle: Bundle | None = None

    def bind(self, base: Checkpoint) -> list[str] | None:
        """Resolve the update's module names against the base checkpoint; return them (None: all targets)."""
        return None

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        """dW of one module, oriented d_out x d_in like ``base_weight`` (dense or low-rank)."""
        raise NotImplementedError


@dataclass
class CheckpointUpdate(UpdateSource):
    """A full fine-tuned checkpoint: dW = W_tuned - W_base, tensor by tensor."""

    tuned: Checkpoint

    def __post_init__(self) -> None:
        self._modules: dict[str, TargetModule] | None = None
        # module -> (TUNED's coarser dtype, ||round(BASE) - BASE||_F), where BASE was rounded to it
        self.rounded: dict[str, tuple[str, float]] = {}
        # module -> BASE's coarser dtype, where TUNED rounded to it is BASE exactly (swapped arguments?)
        self.base_is_rounded_tuned: dict[str, str] = {}

    @property
    def modules(self) -> dict[str, TargetModule]:
        """The tuned checkpoint's modules by name (its own storage: 3-D expert slices, FP8/MXFP4 included)."""
        if self._modules is None:
            self._modules = modules_by_name(self.tuned)
        return self._modules

    def check_targets(self, targets: list[TargetModule], base: Checkpoint) -> None:
        """Before any weight is read: every audited module of BASE is in TUNED with the same [d_out, d_in]."""
        missing = [t for t in targets if t.name not in self.modules]
        if missing and len(missing) == len(targets):
            kinds = _model_types(base, self.tuned)
            raise CheckpointError(
                f"{self.tuned.root}: the fine-tuned checkpoint has none of the {len(targets)} modules audited in "
                f"the base {base.root} (e.g. '{missing[0].name}'){kinds}: it is not a fine-tune of that model; "
                "pass as BASE the model TUNED was fine-tuned from"
            )
        if missing:
            raise CheckpointError(
                f"{self.tuned.root}: the fine-tuned checkpoint has no tensor '{missing[0].logical_name}' (the base "
                f"has it{f'; {len(missing)} modules missing in all' if len(missing) > 1 else ''}); pass a complete "
                "checkpoint, or narrow the audit with --target-modules/--layers"
            )
        for t in targets:
            mine = self.modules[t.name]
            if tuple(mine.shape) != tuple(t.shape):
                raise CheckpointError(
                    f"{mine.tensor.file.name}: module '{t.name}' is [d_out, d_in] = {list(mine.shape)} in the "
                    f"fine-tuned checkpoint but {list(t.shape)} in the base; they are not the same architecture"
                )

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        mine = self.modules.get(target.name)
        if mine is None:
            raise CheckpointError(
                f"{self.tuned.root}: the fine-tuned checkpoint has no tensor '{target.logical_name}' (the base has it)"
            )
        if tuple(mine.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{mine.tensor.file.name}: module '{target.name}' is [d_out, d_in] = {list(mine.shape)} in the "
                f"fine-tuned checkpoint but {list(target.shape)} in the base; they are not the same architecture"
            )
        stored, _ = load_target(self.tuned, mine)
        tuned = stored.to(base_weight.dtype)
        # FP8/MXFP4 read as float32: round BASE to TUNED's codes at TUNED's own scales
        storage, scale = quantized_storage(self.tuned, mine) or (stored.dtype, None)
        reference = rounding_reference(base_weight, tuned, storage, scale)
        if reference is not base_weight and not torch.equal(reference, base_weight):
            floor = float(torch.linalg.vector_norm(reference - base_weight, dtype=torch.float64))
            self.rounded[target.name] = (storage_label(storage), floor)
        out = tuned - reference
        base_storage = DTYPES[target.tensor.dtype].torch if target.tensor.dtype in DTYPES else None
        if (
            reference is base_weight
            and target.scale_nbytes == 0
            and base_storage is not None
            and base_storage.is_floating_point
            and _coarser(stored, base_storage, None)
            and bool(out.any())
            and torch.equal(stored.to(base_storage).to(base_weight.dtype), base_weight)
        ):
            self.base_is_rounded_tuned[target.name] = storage_label(base_storage)
        if not bool(torch.isfinite(out).all()):
            where = f"tensor '{mine.logical_name}'" + (f" (expert {mine.expert})" if mine.expert is not None else "")
            raise CheckpointError(f"{mine.tensor.file.name}: {where} contains NaN or Inf values")
        return out


@dataclass
class LoraUpdate(UpdateSource):
    """A PEFT LoRA adapter dir: dW = s B A, s = alpha/r (alpha/sqrt(r) with rsLoRA), per-module patterns honoured."""

    path: Path
    config: dict[str, Any]
    adapter: Checkpoint
    pairs: dict[str, tuple[str, str]] = field(default_factory=dict)  # peft module name -> (A key, B key)
    mapping: dict[str, str] = field(default_factory=dict)  # base module name -> peft module name

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg.get("use_dora"):
            raise ConfigError(f"{self.path}: DoRA adapters (use_dora) rescale W's columns; audit supports plain LoRA")
        pat = re.compile(r"^(.*)\.lora_A(?:\.[^.]+)?\.weight$")
        for key in self.adapter.tensors:
            if "lora_embedding" in key:
                raise ConfigError(f"{self.path}: '{key}' is an embedding LoRA; audit covers linear layers only")
            hit = pat.match(key)
            if hit:
                b_key = key.replace(".lora_A", ".lora_B", 1)
                if b_key not in self.adapter.tensors:
                    raise CheckpointError(f"{self.path}: has '{key}' but no matching '{b_key}'")
                self.pairs[hit.group(1).removeprefix(_PEFT_PREFIX)] = (key, b_key)
        if not self.pairs:
            raise CheckpointError(f"{self.path}: a LoRA adapter dir without any '*.lora_A.weight' tensor")

    def bind(self, base: Checkpoint) -> list[str]:
        available = [
            n[: -len(".weight")] for n, t in base.tensors.items() if n.endswith(".weight") and len(t.shape) == 2
        ]
        if not any(name in available or _suffix_match(name, available) for name in self.pairs):
            trained_on = self.config.get("base_model_name_or_path")
            example = next(iter(self.pairs))
            raise CheckpointError(
                f"{self.path}: none of the LoRA's {len(self.pairs)} modules (e.g. '{example}') is a module of BASE "
                f"(model_type {base.config.get('model_type')}): the adapter was trained on another model"
                + (f" ({trained_on}, says adapter_config.json)" if trained_on else "")
                + "; pass the model it was trained on as BASE"
            )
        found = resolve_names(list(self.pairs), available, str(self.path))
        self.mapping = {base_name: peft_name for peft_name, base_name in found.items()}
        for base_name, peft_name in self.mapping.items():  # from the headers, before any weight is read
            a_key, b_key = self.pairs[peft_name]
            a_shape, b_shape = (tuple(self.adapter.tensors[k].shape) for k in (a_key, b_key))
            want = tuple(base.tensors[f"{base_name}.weight"].shape)
            if base.config.get("model_type") in CONV1D_FAMILIES:
                want = want[::-1]
            if len(a_shape) != 2 or len(b_shape) != 2 or (b_shape[0], a_shape[1]) != want:
                trained_on = self.config.get("base_model_name_or_path")
                raise CheckpointError(
                    f"{self.path}: the LoRA of '{peft_name}' (lora_A {list(a_shape)}, lora_B {list(b_shape)}) does "
                    f"not fit BASE's weight [d_out, d_in] = {list(want)}: the adapter was trained on another model"
                    + (f" ({trained_on}, says adapter_config.json)" if trained_on else "")
                    + "; pass the model it was trained on as BASE"
                )
        return list(self.mapping)

    def scaling(self, peft_name: str, rank: int) -> float:
        """PEFT's scaling for one module: alpha/r, or alpha/sqrt(r) with use_rslora (patterns first)."""
        cfg = self.config
        r_key = _match_pattern(cfg.get("rank_pattern") or {}, peft_name)
        a_key = _match_pattern(cfg.get("alpha_pattern") or {}, peft_name)
        r = int(cfg["rank_pattern"][r_key]) if r_key else int(cfg.get("r", rank))
        alpha = float(cfg["alpha_pattern"][a_key]) if a_key else float(cfg.get("lora_alpha", r))
        if r != rank:
            raise CheckpointError(
                f"{self.path}: module '{peft_name}' has rank {rank} in the weights but adapter_config.json says {r}"
            )
        return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        peft_name = self.mapping[target.name]
        a_key, b_key = self.pairs[peft_name]
        a, _ = self.adapter.read(a_key)
        b, _ = self.adapter.read(b_key)
        dt = base_weight.dtype
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise CheckpointError(
                f"{self.path}: LoRA tensors of '{peft_name}' have shapes {list(a.shape)}, {list(b.shape)}"
            )
        return LowRankDelta(b.to(dt) * self.scaling(peft_name, a.shape[0]), a.to(dt).contiguous())


@dataclass
class PlateUpdate(UpdateSource):
    """A PLATE adapter: dW = rho A Q^T on B's rows; B and Q come from the adapter's bundle."""

    path: Path
    a_by_name: dict[str, torch.Tensor]  # adapter module name -> A [r, k]
    rho: float | dict[str, float]  # one for every module, or per adapter module name
    bundle: Bundle | None = None
    digests: dict[str, str] | None = None  # save_adapter files: per-module B/Q digests to check
    mapping: dict[str, str] = field(default_factory=dict)  # base module name -> bundle module name
    recorded: str | None = None  # the bundle path the adapter records (where it was looked for)

    def bind(self, base: Checkpoint) -> list[str]:
        from plate_inspect.train.core import geometry_digest

        if self.bundle is None:
            where = (
                f"the bundle this adapter was made with, {self.recorded}, is not there (moved or deleted?)"
                if self.recorded
                else "the adapter records no bundle"
            )
            raise BundleError(f"{self.path}: {where}; pass its new place as bundle=DIR (CLI: --bundle)")
        bundle = self.bundle
        to_bundle = resolve_names(list(self.a_by_name), bundle.modules, f"{self.path} (bundle {bundle.path})")
        self.a_by_name = {to_bundle[n]: a for n, a in self.a_by_name.items()}
        if isinstance(self.rho, dict):
            self.rho = {to_bundle[n]: rho for n, rho in self.rho.items()}
        digests = self.digests or {}
        for name in self.a_by_name if digests else []:
            b_idx, k = bundle.b_idx(name), self.a_by_name[name].shape[-1]
            # the digest does not depend on Q's dtype; a plan trains the prefix Q[:, :k]
            if digests.get(name) != geometry_digest(b_idx, bundle.q(name)[:, :k].contiguous()):
                raise BundleError(f"{self.path}: module '{name}' was trained with another bundle (B/Q digest differs)")
        found = resolve_names(list(self.a_by_name), list(modules_by_name(base)), str(self.path))
        self.mapping = {base_name: bundle_name for bundle_name, base_name in found.items()}
        return list(self.mapping)

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        name = self.mapping[target.name]
        bundle = self.bundle
        assert bundle is not None  # (bind refused an adapter without one)
        a = self.a_by_name[name].to(base_weight.dtype)
        q = bundle.q(name, dtype=base_weight.dtype)
        if a.ndim != 2 or a.shape[0] != bundle.b_idx(name).numel() or not 1 <= a.shape[1] <= q.shape[1]:
            raise BundleError(f"{self.path}: A of '{name}' is {list(a.shape)}, the bundle's B and Q need r x (<= k)")
        q = q[:, : a.shape[1]]  # an adapter trained from a plan uses the prefix Q[:, :k] (bottom-k eigenspace)
        rho = self.rho[name] if isinstance(self.rho, dict) else self.rho
        return LowRankDelta(rho * a, q.T.contiguous(), bundle.b_idx(name))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def _plate_file_update(path: Path, bundle: Bundle | None) -> PlateUpdate:
    from plate_inspect.train.layer import read_adapter

    tensors, meta = read_adapter(path)
    own = meta.get("bundle_path")
    found = Bundle.load(own) if own and (Path(own) / "manifest.json").exists() else bundle
    rho = float(meta["rho"]) if meta.get("rho") is not None else dict(meta["rhos"])  # per module when they differ
    return PlateUpdate(path, tensors, rho, found, meta.get("plate_digests") or None, recorded=own or None)


def _plate_peft_update(path: Path, config: dict[str, Any], bundle: Bundle | None) -> PlateUpdate:
    adapter = Checkpoint.open(path)
    tensors = {}
    for key in adapter.tensors:
        hit = re.match(r"^(.*)\.plate_A(?:\.[^.]+)?$", key)
        if hit:
            tensors[hit.group(1).removeprefix(_PEFT_PREFIX)] = adapter.read(key)[0].clone()
    if not tensors:
        raise CheckpointError(f"{path}: a PLATE adapter dir without any '*.plate_A' tensor")
    own = config.get("bundle")
    found = Bundle.load(own) if own and (Path(own) / "manifest.json").exists() else bundle
    if found is not None and config.get("bundle_signature") not in (None, found.manifest.source_signature):
        raise BundleError(f"{path}: the adapter was trained with a bundle of other weights (source signature differs)")
    return PlateUpdate(path, tensors, float(config.get("rho", 0.5)), found, recorded=own or None)


def _is_plate_file(path: Path) -> bool:
    try:
        _, meta = parse_safetensors_header(path)
    except CheckpointError:
        return False
    return meta.get("format") == "plate-adapter"


def open_update(
    tuned: str | os.PathLike,
    bundle: Bundle | None = None,
    revision: str | None = None,
    offline: bool | None = None,
) -> UpdateSource:
    """Recognise TUNED: PEFT adapter dir (LoRA or plate), PLATE adapter file (or a dir with one), or a checkpoint."""
    path = Path(tuned).expanduser()
    if path.is_dir() and (path / "adapter_config.json").exists():
        config = _read_json(path / "adapter_config.json")
        peft_type = str(config.get("peft_type", "")).upper()
        if peft_type == "LORA":
            if not (path / "adapter_model.safetensors").exists():
                raise CheckpointError(
                    f"{path}: no adapter_model.safetensors (pickled adapter_model.bin is never opened)"
                )
            return LoraUpdate(path, config, Checkpoint.open(path / "adapter_model.safetensors"))
        if peft_type == "PLATE":
            return _plate_peft_update(path, config, bundle)
        raise ConfigError(f"{path}: PEFT adapter type '{peft_type}' is not supported; audit reads LORA and PLATE")
    if path.is_file() and path.suffix == ".safetensors" and _is_plate_file(path):
        return _plate_file_update(path, bundle)
    if path.is_dir() and not (path / "config.json").exists():
        plate_files = [p for p in sorted(path.glob("*.safetensors")) if _is_plate_file(p)]
        if len(plate_files) == 1:
            return _plate_file_update(plate_files[0], bundle)
    return CheckpointUpdate(Checkpoint.open(tuned, revision=revision, offline=offline))


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


def _model_types(base: Checkpoint, other: Checkpoint) -> str:
    """' (model_type a vs b)' when the two configs name different model types, else ''."""
    a, b = (str(c.config.get("model_type") or "?") for c in (base, other))
    return f" (model_type {b} vs {a} for the base)" if a != b else ""


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
                f"pass the bundle of BASE (plate-inspect scan {base} --out DIR, then --bundle DIR), audit against the "
                "model the bundle was scanned from, or leave out --bundle (B is then chosen as the scan does)"
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
        target_modules=target_modules,
        layers=layers,
        precision=precision,
    )
    check_target_patterns(settings.target_modules)
    dtype = PRECISIONS[settings.precision]
    _refuse_bundle_dir(base, "BASE")
    _refuse_bundle_dir(tuned, "TUNED")
    given = bundle if isinstance(bundle, Bundle) or bundle is None else Bundle.load(path_argument(bundle, "bundle"))
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
