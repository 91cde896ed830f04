"""Writers of small quantized safetensors checkpoints (FP8 with scales, MXFP4 blocks) for tests and benchmarks.

The layouts are the ones real checkpoints use: DeepSeek-V3 / Qwen3-FP8 (``<name>_scale_inv`` F32 block grid,
``quantization_config.weight_block_size`` in config.json) and gpt-oss (``<name>_blocks`` uint8 [..., G, 16] and
``<name>_scales`` uint8 E8M0 exponents [..., G]). Quantizing uses torch's float8 casts; readers are tested against
decoders written from the format definitions, never against these writers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

#: Largest finite magnitude of each FP8 format (OCP FP8: E4M3 448, E5M2 57344).
FP8_MAX = {"F8_E4M3": 448.0, "F8_E5M2": 57344.0}
_FP8_TORCH = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] | None = None, fmt: str = "F8_E4M3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and their float32 ``scale_inv`` (dequantized = fp8 x scale_inv): one per tensor, or per block.

    A block grid is [..., ceil(rows/br), ceil(cols/bc)] (edge blocks are partial), as in DeepSeek-V3.
    """
    w = weight.to(torch.float32)
    if block is None:
        scale = (w.abs().amax() / FP8_MAX[fmt]).clamp_min(1e-12)
        return (w / scale).to(_FP8_TORCH[fmt]), scale.reshape(())
    rows, cols = w.shape[-2:]
    br, bc = block
    grid_r, grid_c = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(*w.shape[:-2], grid_r * br, grid_c * bc)
    padded[..., :rows, :cols] = w
    tiles = padded.reshape(*w.shape[:-2], grid_r, br, grid_c, bc)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX[fmt]).clamp_min(1e-12)  # [..., grid_r, grid_c]
    full = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :rows, :cols]
    return (w / full).to(_FP8_TORCH[fmt]), scale


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """One ``model.safetensors`` (and ``config.json`` if given) in directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def fp8_tensors(
    weights: dict[str, torch.Tensor], block: tuple[int, int] | None = (128, 128), fmt: str = "F8_E4M3"
) -> dict[str, torch.Tensor]:
    """``<name>`` FP8 + ``<name>_scale_inv`` F32 for every weight (the DeepSeek-V3 naming: ``weight_scale_inv``)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        q, scale = quantize_fp8(w, block, fmt)
        out[name], out[name + "_scale_inv"] = q, scale.to(torch.float32)
    return out


def fp8_config(block: tuple[int, int] | None = (128, 128), **config: object) -> dict:
    """A config.json with the ``quantization_config`` of DeepSeek-V3 / Qwen3-FP8 releases."""
    quant: dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    return {**config, "quantization_config": quant}


def mxfp4_tensors(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss naming for one MXFP4 weight: ``<name>_blocks`` uint8 [..., G, 16], ``<name>_scales`` uint8 [..., G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError("blocks must be uint8 [..., G, B] and scales uint8 [..., G]")
    return {name + "_blocks": blocks, name + "_scales": scales}


def mxfp4_config(**config: object) -> dict:
    """A config.json with gpt-oss's ``quantization_config``."""
    return {**config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}}
