"""Quantized layouts: which stored tensors make up one logical weight, and which storage plate-inspect reads.

FP8 weights are folded with their ``*_scale_inv``/``*_scale`` tensors (per tensor, per expert, per row or per
block), MXFP4 ``*_blocks`` with their ``*_scales``; every other tensor stands alone as a :class:`LogicalWeight`.
A ``quantization_config`` plate-inspect cannot dequantize and packed integer formats (GPTQ, AWQ, bitsandbytes,
...) are refused here, with what to do instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plate_inspect.dequantize import FP8_DTYPES, FP8_SCALE_DTYPES
from plate_inspect.dtypes import DTYPES, FLOAT_DTYPES
from plate_inspect.errors import CorruptCheckpointError, UnsupportedWeightError
from plate_inspect.safetensors_header import TensorInfo, is_index

__all__ = [
    "COMPRESSED_TENSORS",
    "COMPRESSED_TENSORS_FORMATS",
    "DEQUANTIZE_HINT",
    "SUPPORTED_QUANT_METHODS",
    "LogicalWeight",
    "check_quantization",
    "fold_logical_weights",
    "fp8_block_size",
    "refuse_packed",
    "require_float_dtype",
]

#: What to do with weights in a storage plate-inspect does not read (the end of every such refusal).
DEQUANTIZE_HINT = (
    "scan the unquantized base model it was made from, or dequantize it to bf16 first "
    "(transformers: AutoModelForCausalLM.from_pretrained(DIR, torch_dtype=torch.bfloat16).dequantize()"
    ".save_pretrained(OUT))"
)
#: quantization_config.quant_method values whose storage plate-inspect reads (dequantizing on read).
SUPPORTED_QUANT_METHODS = frozenset({"fp8", "fbgemm_fp8", "mxfp4"})
#: compressed-tensors (llm-compressor) stores weights unpacked in these formats: FP8 codes + ``weight_scale``
#: (per tensor, per row [rows, 1] or per block), or plain floats; packed integer formats are refused.
COMPRESSED_TENSORS = "compressed-tensors"
COMPRESSED_TENSORS_FORMATS = frozenset({"float-quantized", "naive-quantized", "dense"})
#: Tensor-name endings of packed integer formats, with the format they belong to.
_PACKED_SUFFIXES = {
    ".qweight": "GPTQ/AWQ",
    ".qzeros": "GPTQ/AWQ",
    ".g_idx": "GPTQ",
    ".absmax": "bitsandbytes 4-bit",
    ".quant_map": "bitsandbytes 4-bit",
    ".nested_absmax": "bitsandbytes 4-bit",
    ".quant_state.bitsandbytes__nf4": "bitsandbytes 4-bit (nf4)",
    ".quant_state.bitsandbytes__fp4": "bitsandbytes 4-bit (fp4)",
    ".SCB": "bitsandbytes 8-bit",
    ".weight_packed": "compressed-tensors packed integers",
}
#: The same for names other models may use for float tensors too: refused only when the tensor is integer-typed.
_PACKED_INT_SUFFIXES = {
    ".q_weight": "EXL2",
    ".q_invperm": "EXL2",
    ".W_q": "HQQ",
    ".codes": "AQLM",
}


@dataclass(frozen=True)
class LogicalWeight:
    """A weight as a model sees it: logical name and shape, and the stored tensors it is decoded from.

    ``format`` is ``"dense"`` (F64/F32/F16/BF16, read as stored), ``"fp8"`` (F8_E4M3/F8_E5M2 times a scale:
    per tensor, per expert, per row or per block), ``"mxfp4"`` (``<name>_blocks`` + ``<name>_scales``) or
    ``"other"`` (integer/bool/unsupported storage: reading it raises :class:`UnsupportedWeightError`). A quantized
    weight whose scale is missing or malformed keeps its place with a ``problem``, raised when it is read.
    ``parts`` are the stored tensor names (the weight first, then its scales); ``block`` is the FP8 scale block
    [rows, cols] (None for per-tensor scales). ``dtype`` and ``file`` mirror :class:`TensorInfo`.
    """

    name: str
    shape: tuple[int, ...]
    stored_dtype: str  # the weight part's dtype ("BF16", "F8_E4M3", ...) or "MXFP4"
    format: str
    parts: tuple[str, ...]
    file: Path
    block: tuple[int, int] | None = None
    problem: str = ""  # why it cannot be decoded (a missing or malformed scale): raised when it is read

    @property
    def dtype(self) -> str:
        """The stored dtype, under TensorInfo's name for it (so either record fits require_float_dtype)."""
        return self.stored_dtype

    @property
    def is_quantized(self) -> bool:
        """Stored as FP8 or MXFP4 codes with scales (read dequantized to float32)."""
        return self.format in ("fp8", "mxfp4")


def require_float_dtype(info: TensorInfo | LogicalWeight, dequantized: bool = True) -> torch.dtype:
    """The torch dtype a weight is read as, or a clear error for storage plate-inspect does not analyse.

    With ``dequantized`` (the default, for :meth:`Checkpoint.read_weight`), FP8 and MXFP4 storage reads as float32.
    """
    if info.dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[info.dtype]
    if dequantized and (info.dtype in FP8_DTYPES or info.dtype == "MXFP4"):
        return torch.float32
    kind = DTYPES[info.dtype].kind if info.dtype in DTYPES else "unknown"
    file = info.file.name if info.file else "?"
    raise UnsupportedWeightError(
        f"{file}: tensor '{info.name}' is stored as {info.dtype} ({kind}), which plate-inspect does not analyse "
        "(not supported: it reads bf16/fp16/fp32/fp64, and FP8 E4M3/E5M2 or MXFP4 with their scales); "
        + DEQUANTIZE_HINT
    )


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """quantization_config.weight_block_size as (rows, cols), None when the config has none; checked."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("weight_block_size") is None:
        return None
    block = quant["weight_block_size"]
    if not (isinstance(block, list) and len(block) == 2 and all(is_index(b) and b > 0 for b in block)):
        raise CorruptCheckpointError(
            f"config.json: quantization_config.weight_block_size must be two positive integers, got {block!r:.80}"
        )
    return int(block[0]), int(block[1])


def fold_logical_weights(
    tensors: dict[str, TensorInfo], block: tuple[int, int] | None, declared: bool = False
) -> dict[str, LogicalWeight]:
    """Fold FP8 scales and MXFP4 blocks/scales into the weights they belong to; every other tensor stands alone.

    An FP8 tensor without a scale reads as its values (a plain cast, as fp8 diffusion checkpoints store them)
    unless the checkpoint is a scaled one (a quantization_config, or scales beside other FP8 tensors): there a
    missing scale is damage, and reading that weight raises instead of returning codes off by the scale.
    """
    scaled = declared or any(
        info.dtype in FP8_DTYPES and (name + "_scale_inv" in tensors or name + "_scale" in tensors)
        for name, info in tensors.items()
    )
    out: dict[str, LogicalWeight] = {}
    companions: set[str] = set()
    for name, info in tensors.items():
        base = name[: -len("_blocks")]
        scales = tensors.get(base + "_scales")
        # MXFP4 by its storage (U8 blocks) or its pairing (a *_scales beside it): malformed ones get a problem
        if name.endswith("_blocks") and len(info.shape) >= 3 and (info.dtype == "U8" or scales is not None):
            shape = info.shape[:-2] + (info.shape[-2] * info.shape[-1] * 2,)
            where = f"{info.file.name}: MXFP4 weight '{base}'"
            problem = ""
            if info.dtype != "U8":
                problem = f"{where}: '{name}' is stored as {info.dtype}; MXFP4 blocks are U8 (two E2M1 codes a byte)"
            elif scales is None:
                problem = f"{where}: no '{base}_scales' tensor beside '{name}'; the checkpoint is incomplete"
            elif scales.dtype not in ("U8", "F8_E8M0"):
                problem = f"{where}: '{scales.name}' is stored as {scales.dtype}; MXFP4 scales are U8 (E8M0)"
            elif scales.shape != info.shape[:-1]:
                problem = (
                    f"{where}: '{scales.name}' has shape {list(scales.shape)}, the blocks '{name}' need "
                    f"{list(info.shape[:-1])} (one scale per 32-value block)"
                )
            if problem:
                problem += "; re-download or re-convert the checkpoint"
            parts = (name,) if scales is None else (name, scales.name)
            out[base] = LogicalWeight(base, shape, "MXFP4", "mxfp4", parts, info.file, problem=problem)
            companions.update(parts)
    for name, info in tensors.items():
        if info.dtype not in FP8_DTYPES:  # FNUZ variants stay "other": refused on read
            continue
        scale = next((tensors[s] for s in (name + "_scale_inv", name + "_scale") if s in tensors), None)
        if scale is None:
            problem = ""
            if scaled:
                problem = (
                    f"{info.file.name}: FP8 tensor '{name}' has no scale tensor ('{name}_scale_inv' or "
                    f"'{name}_scale'): its codes cannot be dequantized; the checkpoint is incomplete (a shard or an "
                    "index entry missing?), re-download it"
                )
            out[name] = LogicalWeight(name, info.shape, info.dtype, "fp8", (name,), info.file, problem=problem)
            continue
        out[name] = _fp8_weight(info, scale, block)
        companions.add(scale.name)
    for name, info in tensors.items():
        if name in out or name in companions:
            continue
        fmt = "dense" if info.dtype in FLOAT_DTYPES else "other"
        out[name] = LogicalWeight(name, info.shape, info.dtype, fmt, (name,), info.file)
    return out


def _fp8_weight(info: TensorInfo, scale: TensorInfo, block: tuple[int, int] | None) -> LogicalWeight:
    """An FP8 weight with its scale: per tensor ([] / [1]), per expert ([E]), per row ([.., rows, 1]) or block grid."""
    where = f"{scale.file.name}: tensor '{scale.name}' (scale of '{info.name}')"
    if scale.dtype not in FP8_SCALE_DTYPES:
        raise UnsupportedWeightError(
            f"{where} is stored as {scale.dtype}; FP8 scales are F32/BF16/F16/F64 or F8_E8M0, so this is not a scale "
            "plate-inspect can apply: re-download the file, or " + DEQUANTIZE_HINT
        )
    shape, s_shape = info.shape, scale.shape
    if len(shape) < 2:
        raise CorruptCheckpointError(f"{where}: the FP8 weight has shape {list(shape)}, scales need 2+ dims")
    lead, (rows, cols) = shape[:-2], shape[-2:]

    def with_block(block: tuple[int, int] | None) -> LogicalWeight:
        return LogicalWeight(info.name, shape, info.dtype, "fp8", (info.name, scale.name), info.file, block)

    if math.prod(s_shape) == 1:
        return with_block(None)  # one scale for the whole tensor
    rest = s_shape[len(lead) :]
    if s_shape[: len(lead)] == lead:
        if lead and math.prod(rest) == 1 and len(rest) <= 2:
            return with_block((rows, cols))  # one scale per expert
        if rest in ((rows,), (rows, 1)):
            return with_block((1, cols))  # one scale per output row
        if len(rest) == 2 and block is not None:
            expected = (-(-rows // block[0]), -(-cols // block[1]))
            if rest == expected:
                return with_block(block)
            raise CorruptCheckpointError(
                f"{where}: scale grid {list(s_shape)} does not match weight {list(shape)} with "
                f"quantization_config.weight_block_size {list(block)} (expected {list(lead + expected)}); use the "
                "config.json that came with the weights, or re-download this file"
            )
    hint = (
        "; re-download this file"
        if block is not None
        else "; block scales need quantization_config.weight_block_size in config.json (use the config.json that "
        "came with the weights)"
    )
    raise CorruptCheckpointError(f"{where}: scale shape {list(s_shape)} does not fit weight {list(shape)}{hint}")


def refuse_packed(tensors: dict[str, TensorInfo]) -> None:
    """Packed integer formats (GPTQ, AWQ, bitsandbytes, EXL2, HQQ, AQLM, ...) are refused up front, naming the
    format (without this, a checkpoint whose layers hold only packed tensors read as one with no layer weights)."""
    for name in sorted(tensors):
        integer = tensors[name].dtype not in FLOAT_DTYPES
        for suffix, fmt in (_PACKED_SUFFIXES | _PACKED_INT_SUFFIXES if integer else _PACKED_SUFFIXES).items():
            if name.endswith(suffix):
                raise UnsupportedWeightError(
                    f"tensor '{name}' is a packed quantized weight ({fmt}), which plate-inspect does not read; "
                    + DEQUANTIZE_HINT
                )


def check_quantization(path: Path, quant: Any) -> None:
    """Refuse a quantization_config whose storage plate-inspect cannot dequantize, naming the method and format."""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not isinstance(method, str):
        raise UnsupportedWeightError(
            f"{path}: quantization_config has no quant_method, so the storage is unknown; plate-inspect reads "
            "FP8 with scales (fp8, fbgemm_fp8, compressed-tensors float-quantized) and MXFP4; " + DEQUANTIZE_HINT
        )
    if method == COMPRESSED_TENSORS:
        fmt = quant.get("format")
        if fmt in COMPRESSED_TENSORS_FORMATS:
            return
        raise UnsupportedWeightError(
            f"{path}: the checkpoint is compressed-tensors with format {fmt!r}, which plate-inspect does not read "
            f"(it reads the formats {', '.join(sorted(COMPRESSED_TENSORS_FORMATS))}: FP8 or unquantized "
            "weights stored as they are); " + DEQUANTIZE_HINT
        )
    if method not in SUPPORTED_QUANT_METHODS:
        raise UnsupportedWeightError(
            f"{path}: the checkpoint is quantized with '{method}', which plate-inspect does not read (it reads FP8 "
            "with scales: fp8, fbgemm_fp8, compressed-tensors float-quantized; and MXFP4); " + DEQUANTIZE_HINT
        )
