"""Is this model's weight the one a bundle was made for?  Exact sha256 first, then a dtype-tolerant sketch.

A bundle records, per module, the sha256 fingerprint of the weight's stored bytes. An upcast model (bf16 checkpoint
loaded in float32) passes exactly: the weight is cast back to the stored dtype before hashing. A *downcast* model
(float32 checkpoint loaded with ``torch_dtype=bfloat16``, or ``model.to(torch.bfloat16)``) holds a rounded copy,
whose bytes differ; B and Q are still valid for it. So does a model holding the dequantized weights of an FP8 or
MXFP4 checkpoint (the scan read them dequantized to float32), and a bf16 checkpoint loaded in float16 (entries
below float16's normal range round). For those cases (and only those: the model's dtype cannot hold every stored
value exactly, or the storage is quantized) the check compares a seeded sketch
``S = L W R`` (L: [8, d_out], R: [d_in, 8], standard normal, float64) of the model's weight with the sketch of the
reference weight:

    ||S_model - S_ref||_F / (8 ||W_ref||_F)  <=  2 u(model dtype)   (quantized storage: 2 max(u(model), u(float32)))

(plus float16's subnormal spacing term, negligible for real weights: ``cast_tolerance``).

For a rounded copy, ``|E_ij| <= u |W_ij|`` so ``||E||_F <= u ||W||_F``, and ``||L E R||_F / 8`` estimates
``||E||_F`` (E[(l^T E r)^2] = ||E||_F^2 for each of the 64 entries); rounding errors give about u/sqrt(3), well
inside the bound. Any change larger than about 2u relative (0.8% of ||W||_F for bfloat16, 0.1% for float16) is
refused: another model, another revision or a fine-tune. Smaller changes are invisible after rounding anyway.

The reference sketch comes from the adapter (recorded when the adapter was created on verified weights) or, when
there is none, from the bundle's source checkpoint (read once, its fingerprint checked against the bundle). If
neither is available the rounded model is refused with a message saying how to proceed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from plate_inspect.checkpoint import FP8_DTYPES, fingerprint_tensor
from plate_inspect.dtypes import FLOAT_DTYPES
from plate_inspect.errors import BundleError, PlateInspectError

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle

SKETCH_SIZE = 8
SKETCH_SEED = 20240917
TOLERANCE_UNITS = 2.0  # allowed ||E||_F / ||W||_F in units of the model dtype's unit roundoff
#: Stored dtypes a model never holds as such: the weight is their float32 dequantization, checked by sketch.
QUANTIZED_DTYPES = frozenset({*FP8_DTYPES, "MXFP4"})


class WeightRecord(Protocol):
    """What the weight check reads of a module's record: a bundle's ModuleRecord, or the one a PEFT adapter that
    carries its B/Q saved (``name``: the bundle's module name, read only to find the bundle's source weight)."""

    @property
    def name(self) -> str:
        """The bundle's module name (used only to find the bundle's source weight)."""

    @property
    def shape(self) -> list[int]:
        """The weight's shape, [d_out, d_in]."""

    @property
    def dtype(self) -> str:
        """The weight's stored dtype (e.g. BF16, F8_E4M3)."""

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the weight's stored bytes, as the bundle recorded it."""


@dataclass(frozen=True)
class WeightSketch:
    """L W R of an oriented [d_out, d_in] weight (float64), with ||W||_F: a dtype-tolerant identity."""

    values: tuple[tuple[float, ...], ...]
    fro: float
    seed: int = SKETCH_SEED

    def to_json(self) -> dict[str, Any]:
        """The sketch as a JSON object (what adapters record of the weight they were made on)."""
        return {"seed": self.seed, "fro": self.fro, "values": [list(v) for v in self.values]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WeightSketch:
        """The sketch back from :meth:`to_json`'s dict."""
        return cls(tuple(tuple(float(x) for x in row) for row in d["values"]), float(d["fro"]), int(d["seed"]))


def full_weight(module: nn.Module) -> torch.Tensor:
    """The module's weight as one local tensor (gathers an FSDP2 / DTensor-sharded parameter)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__}.weight is not a tensor"
    w = weight.detach()
    return w.full_tensor() if hasattr(w, "full_tensor") else w


def oriented(w: torch.Tensor, layout: str) -> torch.Tensor:
    """[d_out, d_in] view of a stored weight (GPT-2 Conv1D stores [d_in, d_out])."""
    return w.t() if layout == "conv1d" else w


def sketch_weight(w: torch.Tensor, seed: int = SKETCH_SEED, block_rows: int = 4096) -> WeightSketch:
    """The seeded sketch L W R (float64) of an oriented [d_out, d_in] weight, read in row blocks."""
    d_out, d_in = w.shape
    g = torch.Generator().manual_seed(seed)
    left = torch.randn(SKETCH_SIZE, d_out, generator=g, dtype=torch.float64)
    right = torch.randn(d_in, SKETCH_SIZE, generator=g, dtype=torch.float64)
    s = torch.zeros(SKETCH_SIZE, SKETCH_SIZE, dtype=torch.float64)
    fro2 = 0.0
    for i in range(0, d_out, block_rows):
        blk = w[i : i + block_rows].detach().to("cpu", torch.float64)
        s += left[:, i : i + block_rows] @ (blk @ right)
        fro2 += float(blk.square().sum())
    return WeightSketch(tuple(tuple(row) for row in s.tolist()), math.sqrt(fro2), seed)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of a floating dtype (float32: 2^-24, bfloat16: 2^-8, float16: 2^-11)."""
    return torch.finfo(dtype).eps / 2


def holds_exactly(model_dtype: torch.dtype, stored_dtype: torch.dtype) -> bool:
    """True when every finite value of ``stored_dtype`` is a value of ``model_dtype`` (an upcast: nothing rounds).

    bfloat16 -> float32 is exact; float32 -> bfloat16 rounds the mantissa; bfloat16 -> float16 rounds values outside
    float16's narrower exponent range (its subnormals), although float16 has the finer mantissa.
    """
    m, s = torch.finfo(model_dtype), torch.finfo(stored_dtype)
    return m.eps <= s.eps and m.max >= s.max and m.smallest_normal * m.eps <= s.smallest_normal * s.eps


def cast_tolerance(model_dtype: torch.dtype, stored_dtype: torch.dtype, numel: int, fro: float) -> float:
    """The largest ||E||_F / ||W||_F the sketch check accepts for a copy of W (stored dtype) rounded to the model's.

    Rounding to the model dtype moves each entry by at most u |w_ij| (normal range) or half the subnormal spacing
    (float16 holds values below 6.1e-5 with absolute spacing 6e-8), so ||E||_F <= u ||W||_F + spacing / 2 sqrt(numel);
    the bound allows ``TOLERANCE_UNITS`` times that, with u the larger of the two dtypes' unit roundoffs.
    """
    info = torch.finfo(model_dtype)
    u = max(unit_roundoff(model_dtype), unit_roundoff(stored_dtype))
    if unit_roundoff(model_dtype) < unit_roundoff(stored_dtype) and not holds_exactly(model_dtype, stored_dtype):
        u = unit_roundoff(model_dtype)  # finer mantissa (bf16 -> fp16): only the model's own rounding
    subnormal = info.smallest_normal * info.eps / 2 * math.sqrt(numel) / max(fro, 1e-300)
    return TOLERANCE_UNITS * (u + subnormal)


def sketch_distance(model: WeightSketch, ref: WeightSketch) -> float:
    """||S_model - S_ref||_F / (sqrt(#entries) ||W_ref||_F): an estimate of ||W_model - W_ref||_F / ||W_ref||_F."""
    a, b = torch.tensor(model.values, dtype=torch.float64), torch.tensor(ref.values, dtype=torch.float64)
    return float((a - b).norm()) / (math.sqrt(a.numel()) * max(ref.fro, 1e-300))


def weight_fingerprint(w: torch.Tensor, stored_dtype: str) -> str:
    """Fingerprint of a weight in the checkpoint's stored dtype (an upcast model still matches)."""
    dt = FLOAT_DTYPES.get(stored_dtype)
    if dt is not None and w.dtype != dt:
        w = w.to(dt)
    return fingerprint_tensor(w)


def source_reference(bundle: Bundle, name: str) -> WeightSketch | None:
    """The sketch of module ``name``'s weight read from the bundle's source checkpoint, if it is here and unchanged."""
    from plate_inspect.checkpoint import Checkpoint

    src = bundle.manifest.source or {}
    record = bundle.record(name)
    try:
        if src.get("kind") == "local":
            if not Path(src["id"]).exists():
                return None
            ckpt = Checkpoint.open(src["id"])
        elif src.get("kind") == "hub":
            ckpt = Checkpoint.open(src["id"], revision=src.get("commit") or src.get("revision"), offline=True)
        else:
            return None
        w, fp = _read_reference(ckpt, name, record.layout)
    except (PlateInspectError, OSError, KeyError):
        return None
    if fp != record.fingerprint:
        return None
    return sketch_weight(w.t() if record.layout in ("conv1d", "experts_in_major") else w)


def _read_reference(ckpt: Any, name: str, layout: str) -> tuple[torch.Tensor, str]:
    """Module ``name``'s stored weight and fingerprint: ``<name>.weight``, or for an expert of a 3-D stack
    (module ``<tensor>.<e>``) that expert's slice of ``<tensor>.weight`` / ``<tensor>``."""
    if layout not in ("experts_out_major", "experts_in_major"):
        return ckpt.read_weight(f"{name}.weight")
    stem, _, e = name.rpartition(".")
    tensor = f"{stem}.weight" if f"{stem}.weight" in ckpt.tensors else stem
    return ckpt.read_weight(tensor, expert=int(e))


def check_weight(
    module: nn.Module,
    name: str,
    record: WeightRecord,
    layout: str,
    reference: WeightSketch | None = None,
    bundle: Bundle | None = None,
    adapter: bool = False,
) -> WeightSketch:
    """Refuse (BundleError) a weight that is neither the bundle's nor a rounded copy of it; return its reference sketch.

    The returned sketch is the one to record in an adapter: of the model's weight when it matched exactly, else the
    reference it was compared with. ``adapter``: a saved adapter is being loaded (the refusal says what to do then).
    """
    return check_weight_tensor(full_weight(module), name, record, layout, reference, bundle, adapter)


def check_weight_tensor(
    w: torch.Tensor,
    name: str,
    record: WeightRecord,
    layout: str,
    reference: WeightSketch | None = None,
    bundle: Bundle | None = None,
    adapter: bool = False,
) -> WeightSketch:
    """``check_weight`` on a weight tensor in its stored layout (one expert's block of a fused 3-D parameter)."""
    if weight_fingerprint(w, record.dtype) == record.fingerprint:
        return reference or sketch_weight(oriented(w, layout))
    # quantized storage (FP8 codes x scales, MXFP4): the scan read it dequantized to float32, correctly rounded, so
    # a model holding the dequantized weights is a rounded copy of those float32 values (float32 itself included)
    quantized = record.dtype in QUANTIZED_DTYPES
    stored = torch.float32 if quantized else FLOAT_DTYPES.get(record.dtype)
    fix = (
        "this adapter was trained on other base weights: load it onto the base model it was made for"
        if adapter
        else "the bundle was made for other weights; rescan this checkpoint (plate-inspect scan) or load the right one"
    )
    refused = f"module '{name}': weight fingerprint differs from the bundle's ({record.fingerprint[:19]}...): {fix}"
    if stored is None or not w.is_floating_point():
        raise BundleError(refused)
    if not quantized and holds_exactly(w.dtype, stored):  # an upcast is exact: the fingerprint must have matched
        raise BundleError(refused)
    if reference is None and bundle is not None:
        reference = source_reference(bundle, record.name)  # the bundle's name; ``name`` is the model's
    if reference is None:
        how = (
            "keep the quantized source checkpoint where the bundle recorded it (its dequantized weights are the "
            "reference)"
            if quantized
            else "load the model in its stored dtype for get_peft_model/apply_bundle (cast it afterwards), or keep "
            "the source checkpoint where the bundle recorded it"
        )
        raise BundleError(
            f"module '{name}': the model holds {str(w.dtype).removeprefix('torch.')} weights but the bundle was made "
            f"for {record.dtype} ones, and neither an adapter nor the bundle's source checkpoint is here to check "
            f"the rounded copy against; {how}"
        )
    distance = sketch_distance(sketch_weight(oriented(w, layout)), reference)
    limit = cast_tolerance(w.dtype, stored, w.numel(), reference.fro)
    if not distance <= limit:
        raise BundleError(
            f"{refused} (a {str(w.dtype).removeprefix('torch.')} copy of the bundle's weights would differ by at "
            f"most {limit:.1e} relative; this one differs by about {distance:.1e})"
        )
    return reference
