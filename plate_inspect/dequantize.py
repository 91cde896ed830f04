"""Dequantization as pure functions: FP8 (E4M3/E5M2) codes with per-tensor, per-row or block scales, E8M0 scale
codes, and MXFP4 blocks, decoded exactly to float32. :class:`plate_inspect.checkpoint.Checkpoint` reads the bytes;
these turn them into values.
"""

from __future__ import annotations

import torch

from plate_inspect.dtypes import DTYPES, FLOAT_DTYPES
from plate_inspect.errors import UnsupportedWeightError

__all__ = [
    "FP4_E2M1_VALUES",
    "FP8_DTYPES",
    "FP8_SCALE_DTYPES",
    "broadcast_scale",
    "decode_e8m0",
    "decode_fp8",
    "decode_fp8_scale",
    "decode_mxfp4",
    "expand_block_scale",
    "fp8_scale_problem",
    "tensor_from_bytes",
]

#: FP8 element formats dequantized on read (OCP FP8: E4M3 "fn" with NaN only at S.1111.111, E5M2 IEEE-like).
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: FP4 E2M1 values by 4-bit code (OCP Microscaling Formats v1.0, section 5.3.3): sign, 2 exponent bits, 1 mantissa.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def tensor_from_bytes(raw: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Freshly read bytes as a tensor of ``dtype`` and ``shape``, sharing their memory (no copy)."""
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def decode_fp8(raw: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """FP8 bytes (F8_E4M3 or F8_E5M2) -> float32 values of the given shape (exact: every FP8 value is a float32)."""
    torch_dtype = DTYPES[dtype].torch
    if torch_dtype is None:
        raise UnsupportedWeightError(f"this torch build has no {dtype} dtype; upgrade torch to read FP8 weights")
    if not raw:
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape).to(torch.float32)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(rows/br), ceil(cols/bc)] block scale grid -> the [rows, cols] per-element scale (edges cut off)."""
    br, bc = block
    return scale.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]


def broadcast_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None) -> torch.Tensor:
    """A flat FP8 scale broadcast to the weight's shape: one scalar, or a grid of [br, bc] blocks (edges cut off)."""
    if block is None:
        return scale.reshape(())
    rows, cols = shape[-2:]
    grid = shape[:-2] + (-(-rows // block[0]), -(-cols // block[1]))
    return expand_block_scale(scale.reshape(grid), rows, cols, block)


#: Stored dtypes of FP8 weight scales: IEEE floats, or unsigned power-of-two exponents (UE8M0, as transformers'
#: fine-grained FP8 accepts for ``weight_scale_inv``).
FP8_SCALE_DTYPES = (*FLOAT_DTYPES, "F8_E8M0")


def decode_fp8_scale(raw: bytearray, dtype: str) -> torch.Tensor:
    """A flat FP8 scale tensor's bytes -> its values: floats as stored (F64 kept), F8_E8M0 codes as 2^(code - 127)."""
    if dtype == "F8_E8M0":
        return decode_e8m0(tensor_from_bytes(raw, torch.uint8, (len(raw),)))
    return tensor_from_bytes(raw, FLOAT_DTYPES[dtype], (len(raw) * 8 // DTYPES[dtype].bits,))


def fp8_scale_problem(scale: torch.Tensor) -> tuple[str, int, float] | None:
    """Why a (flat) FP8 scale tensor cannot be a quantizer's output, or None: every scale must be finite and > 0.

    Quantizers store scale = amax / FP8 max (transformers' fine-grained FP8 stores 1.0 for an all-zero block,
    llm-compressor and fbgemm clamp to a tiny positive minimum), and the unsigned UE8M0 scale format has no sign:
    NaN, infinity, zero and negative scales are damage (a negative one decodes to a weight with a block's sign
    flipped, a model nobody trained). Returns (counts by kind, flat index of the first bad scale, its value).
    """
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return None
    kinds = {
        "NaN": torch.isnan(scale),
        "infinite": torch.isinf(scale),
        "zero": scale == 0,
        "negative": torch.isfinite(scale) & (scale < 0),
    }
    counts = [f"{int(m.sum())} {kind}" for kind, m in kinds.items() if bool(m.any())]
    total = scale.numel()
    what = ", ".join(counts) + f" of {total} scale{'s' if total != 1 else ''}"
    if bool((scale == 0).all()):
        what += " (all zero: the weight would dequantize to zeros)"
    first = int(bad.flatten().nonzero()[0])
    return what, first, float(scale.flatten()[first])


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 scale codes (uint8) -> float32 2^(code - 127); code 255 is NaN (OCP MX v1.0, section 5.4)."""
    exponent = codes.to(torch.int32) - 127
    out = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32), exponent)
    return out.masked_fill(codes == 255, float("nan"))


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``[..., G, B]`` uint8 blocks (two E2M1 codes per byte, low nibble first) and ``[..., G]`` E8M0 scales
    -> float32 ``[..., G * 2B]``: element = E2M1 value x 2^(scale - 127)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # low nibble is the earlier element
    values = lut[codes].flatten(-2)  # [..., G, 2B]
    out = values * decode_e8m0(scales).unsqueeze(-1)  # power-of-two scaling: exact unless it over/underflows
    return out.flatten(-2)
