"""The one dtype table: every safetensors dtype name with its bit size, kind and torch dtype (where torch has one).

Readers (header validation, tensor reads), writers (bundle Q dtypes), the merger and the settings validators all
import it, so a dtype is described once. Sizes are in bits because the format has sub-byte types (F4, F6_*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its name in a header, bits per element, kind, and torch dtype (None if torch has none)."""

    name: str
    bits: int
    kind: str  # "float" | "int" | "uint" | "bool" | "complex" | "fp8" | "fp6" | "fp4" | "scale"
    torch: torch.dtype | None
    torch_name: str | None = None  # the user-facing name ("float32") for dtypes a setting can choose

    @property
    def is_float(self) -> bool:
        """Ordinary IEEE-style floating storage that plate-inspect analyses as is (F64/F32/F16/BF16)."""
        return self.kind == "float"


def _torch(name: str) -> torch.dtype | None:
    """A torch dtype by attribute name, or None on a torch build without it (feature check, not version check)."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


_ENTRIES = (
    DType("BOOL", 8, "bool", torch.bool),
    DType("U8", 8, "uint", torch.uint8),
    DType("I8", 8, "int", torch.int8),
    DType("F8_E5M2", 8, "fp8", _torch("float8_e5m2")),
    DType("F8_E4M3", 8, "fp8", _torch("float8_e4m3fn")),
    DType("F8_E5M2FNUZ", 8, "fp8", _torch("float8_e5m2fnuz")),
    DType("F8_E4M3FNUZ", 8, "fp8", _torch("float8_e4m3fnuz")),
    DType("F8_E8M0", 8, "scale", _torch("float8_e8m0fnu")),
    DType("F6_E2M3", 6, "fp6", None),
    DType("F6_E3M2", 6, "fp6", None),
    DType("F4", 4, "fp4", None),  # torch's float4_e2m1fn_x2 packs two per element: not a 1:1 element type
    DType("I16", 16, "int", torch.int16),
    DType("U16", 16, "uint", _torch("uint16")),
    DType("F16", 16, "float", torch.float16, "float16"),
    DType("BF16", 16, "float", torch.bfloat16, "bfloat16"),
    DType("I32", 32, "int", torch.int32),
    DType("U32", 32, "uint", _torch("uint32")),
    DType("F32", 32, "float", torch.float32, "float32"),
    DType("C64", 64, "complex", torch.complex64),
    DType("F64", 64, "float", torch.float64, "float64"),
    DType("I64", 64, "int", torch.int64),
    DType("U64", 64, "uint", _torch("uint64")),
)

#: Every dtype name the safetensors format defines -> its description.
DTYPES: dict[str, DType] = {d.name: d for d in _ENTRIES}

#: Floating dtypes analysed as stored (safetensors name -> torch dtype).
FLOAT_DTYPES: dict[str, torch.dtype] = {d.name: d.torch for d in _ENTRIES if d.is_float and d.torch is not None}


def by_torch_name(*names: str) -> dict[str, torch.dtype]:
    """User-facing dtype names ("float32", ...) -> torch dtypes, for the settings that choose one."""
    table = {d.torch_name: d.torch for d in _ENTRIES if d.torch_name and d.torch is not None}
    return {n: table[n] for n in names}


#: Dtypes a bundle may store Q in (``--q-dtype``).
Q_DTYPES: dict[str, torch.dtype] = by_torch_name("float32", "bfloat16", "float16")
#: Working precisions of the scan (``--precision``).
PRECISIONS: dict[str, torch.dtype] = by_torch_name("float32", "float64")


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype whose elements are exactly this safetensors dtype's elements (None: unknown or sub-byte)."""
    entry = DTYPES.get(name)
    return entry.torch if entry is not None else None


def safetensors_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (the inverse of :func:`torch_dtype`)."""
    for d in _ENTRIES:
        if d.torch == dtype:
            return d.name
    raise KeyError(f"no safetensors dtype for {dtype}")
