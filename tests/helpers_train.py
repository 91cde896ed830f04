"""Helpers for the trainer-side tests: tiny digits checkpoints and bundles, skeleton models, dense oracles."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from plate_inspect import scan
from plate_inspect.bundle import Bundle
from plate_inspect.experiments import digits

BACKBONE = ["fc1", "fc2", "fc3"]


def digits_checkpoint(out: Path, seed: int = 0, epochs: int = 0) -> tuple[digits.DigitsMLP, Path]:
    """A DigitsMLP (trained on task 1 by the one stage-1 trainer when ``epochs``) saved as one safetensors file."""
    if epochs:
        model = digits.train_stage1(digits.load_digit_tasks()[0], seed=seed, epochs=epochs)
    else:
        model = digits.initial_model(64, seed)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    digits.save_model(model, path)
    return model, path


def digits_bundle(ckpt: Path, out: Path, r: int = 16, tau: float = 0.8):
    return scan(ckpt, out, r=r, tau=tau, max_rank=256, target_modules=BACKBONE, overwrite=True)


def digits_setup(root: Path, r: int = 16, tau: float = 0.8) -> tuple[Path, Path, object]:
    """(root, checkpoint, bundle): an untrained seed-0 digits checkpoint and its bundle, the trainer tests' fixture."""
    _, ckpt = digits_checkpoint(root / "ckpt", seed=0)
    return root, ckpt, digits_bundle(ckpt, root / "bundle", r=r, tau=tau)


def load_digits(path: Path) -> digits.DigitsMLP:
    model = digits.DigitsMLP()
    model.load_state_dict(load_file(str(path)))
    return model


def dense_plate_weight(w: torch.Tensor, b_idx: torch.Tensor, a: torch.Tensor, q: torch.Tensor, rho: float):
    """W + rho * E_B A Q^T in float64, with E_B built as a dense d_out x r selector (the oracle)."""
    d_out = w.shape[0]
    e_b = torch.zeros(d_out, b_idx.numel(), dtype=torch.float64)
    e_b[b_idx, torch.arange(b_idx.numel())] = 1.0
    return w.double() + rho * e_b @ a.double() @ q.double().T


def randomize_adapters(params, seed: int = 0, scale: float = 0.5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def skeleton(path: Path, names: list[str], layout: str = "linear") -> nn.Module:
    """A module tree holding only the named layers, with the checkpoint's weights (Linear or Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    root = nn.Module()
    for name in names:
        w = tensors[f"{name}.weight"]
        bias = tensors.get(f"{name}.bias")
        if layout == "conv1d":
            layer = Conv1D(w.shape[1], w.shape[0])
        else:
            layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
        layer = layer.to(w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
            if bias is not None:
                layer.bias.copy_(bias)
        parent = root
        parts = name.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(parts[-1], layer)
    return root


def save_tiny_qwen2(path: Path, *, vocab: int = 64, intermediate: int = 48, seed: int = 0) -> Path:
    """A randomly initialised tiny Qwen2ForCausalLM (the real architecture), saved as safetensors at ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def model_holding(weights: dict[str, torch.Tensor]) -> nn.Module:
    """Bias-free nn.Linear modules at the weights' dotted names (module = name without '.weight')."""
    root = nn.Module()
    for name, w in weights.items():
        *path, leaf = name.removesuffix(".weight").split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.clone()
        parent.add_module(leaf, linear)
    return root


def fp8_setup(root: Path) -> tuple[Bundle, dict[str, torch.Tensor], Path]:
    """A 1-layer Qwen2-shaped checkpoint with its 7 projections in FP8 (16 x 16 block scales), its bundle, and the
    projections dequantized here from codes and scales (the product rounded once to float32): the weights a
    model holds when it loads that checkpoint dequantized."""
    from plate_inspect.testing.quantized import fp8_config, fp8_tensors, write_safetensors
    from plate_inspect.testing.synthetic import write_llama_like

    src = write_llama_like(root / "src", layers=1)
    stored = {}
    for f in sorted(src.path.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    targets = {n: w.float() for n, w in stored.items() if n.endswith("_proj.weight")}
    quantized = fp8_tensors(targets, block=(16, 16))
    others = {n: w for n, w in stored.items() if n not in targets}
    fp8_dir = write_safetensors(root / "fp8", {**others, **quantized}, fp8_config((16, 16), **src.config))
    bundle = scan(fp8_dir, root / "bundle", r=4, max_rank=40)
    dequantized = {}
    for name in targets:
        scale = quantized[name + "_scale_inv"].repeat_interleave(16, 0).repeat_interleave(16, 1)
        codes = quantized[name].float()
        dequantized[name] = codes * scale[: codes.shape[0], : codes.shape[1]]
    return bundle, dequantized, fp8_dir
