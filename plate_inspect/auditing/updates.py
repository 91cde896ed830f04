"""An update dW as the audit holds it (dense, or low rank, never formed densely), and the storage rounding model:
what TUNED holds where it is BASE saved coarser (bf16, FP8 at its scales, MXFP4). Pure functions of tensors."""

from dataclasses import dataclass
from typing import Union

import torch

from plate_inspect.checkpoint import (
    Checkpoint,
)
from plate_inspect.dtypes import DTYPES
from plate_inspect.geometry import (
    matmul,
)
from plate_inspect.targets import (
    EXPERT_LAYOUTS,
    TargetModule,
)

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


def coarser(weight: torch.Tensor, dtype: Storage, scale: torch.Tensor | None) -> bool:
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
    if not coarser(weight, dtype, scale):
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
