"""Synthetic HF-style checkpoints with real names and layouts (Qwen2/Llama, GPT-2 Conv1D, BERT).

For tests and benchmarks on machines without hub access: weights have a decaying spectrum (not iid noise)
and, optionally, planted groups of near-duplicate rows whose indices are known.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass
class SyntheticCheckpoint:
    """Where a generated checkpoint lives, and the rows planted as duplicates in each weight."""

    path: Path
    config: dict
    planted_rows: dict[str, list[int]] = field(default_factory=dict)  # module name -> planted row indices
    total_bytes: int = 0


def structured_weight(
    d_out: int,
    d_in: int,
    generator: torch.Generator,
    decay: float = 0.05,
    planted: int = 0,
    noise: float = 0.02,
) -> tuple[torch.Tensor, list[int]]:
    """A float32 d_out x d_in weight with a decaying column energy profile and ``planted`` near-duplicate rows.

    Column j is scaled by exp(-decay * 64 * j / d_in), so W^T W has a decaying spectrum. The planted rows are
    one prototype row plus small noise: they are the most colinear rows, so a correct B must select them.
    """
    scale = torch.exp(-decay * 64.0 * torch.arange(d_in, dtype=torch.float32) / d_in)
    w = torch.randn(d_out, d_in, generator=generator) * scale / math.sqrt(d_in)
    rows: list[int] = []
    if planted:
        rows = sorted(torch.randperm(d_out, generator=generator)[:planted].tolist())
        proto = w[rows[0]].clone()
        jitter = torch.randn(planted, d_in, generator=generator) * scale / math.sqrt(d_in)
        w[rows] = proto[None, :] + noise * jitter
    return w, rows


def _save_single(tensors: dict[str, torch.Tensor], out: Path) -> int:
    """Save tensors as ``out/model.safetensors``; returns the bytes of tensor data."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_llama_like(
    out: str | Path,
    *,
    model_type: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 176,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
    planted_fraction: float = 0.0,
    seed: int = 0,
    spectrum_alpha: float | None = None,
) -> SyntheticCheckpoint:
    """A Qwen2/Llama-layout checkpoint (``model.layers.N.self_attn.q_proj.weight`` ...) + config.json.

    Each weight gets ``planted_fraction`` of its rows as near-duplicates of one prototype (recorded in
    ``planted_rows``); with ``spectrum_alpha`` weights get power-law spectra instead (:func:`hard_spectrum_weight`,
    Gaussian factors). Layers are generated and freed one at a time when sharding, so a 7B-shaped checkpoint
    needs no more memory than one layer.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rms_norm_eps": 1e-6,
    }
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    ckpt = SyntheticCheckpoint(out, config)
    pending: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype)
    }
    weight_map: dict[str, str] = {}
    shard_files: list[str] = []

    def flush(force: bool = False) -> None:
        """Write the pending tensors as the next shard once they reach max_shard_bytes (or when forced)."""
        size = sum(t.numel() * t.element_size() for t in pending.values())
        if pending and (force or (max_shard_bytes and size >= max_shard_bytes)):
            fname = f"model-{len(shard_files) + 1:05d}.safetensors"
            save_file(dict(pending), str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in pending})
            shard_files.append(fname)
            ckpt.total_bytes += size
            pending.clear()

    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for suffix, (d_out, d_in) in shapes.items():
            if spectrum_alpha is None:
                w, rows = structured_weight(d_out, d_in, gen, planted=round(planted_fraction * d_out))
            else:
                w, rows = hard_spectrum_weight(d_out, d_in, gen, alpha=spectrum_alpha, orthogonal=False), []
            name = f"{prefix}.{suffix}"
            pending[f"{name}.weight"] = w.to(dtype)
            if rows:
                ckpt.planted_rows[name] = rows
        pending[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        pending[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        if model_type == "qwen2":
            for proj, n in (
                ("q_proj", heads * head_dim),
                ("k_proj", kv_heads * head_dim),
                ("v_proj", kv_heads * head_dim),
            ):
                pending[f"{prefix}.self_attn.{proj}.bias"] = torch.zeros(n, dtype=dtype)
        if max_shard_bytes:
            flush()
    pending["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    pending["lm_head.weight"] = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype)
    if max_shard_bytes:
        flush(force=True)
        n = len(shard_files)
        renamed = {}
        for i, fname in enumerate(shard_files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (out / fname).rename(out / final)
            renamed[fname] = final
        index = {
            "metadata": {"total_size": ckpt.total_bytes},
            "weight_map": {k: renamed[v] for k, v in weight_map.items()},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        ckpt.total_bytes = _save_single(pending, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


def write_gpt2(
    out: str | Path, *, layers: int = 2, n_embd: int = 48, dtype: torch.dtype = torch.float32, seed: int = 0
) -> SyntheticCheckpoint:
    """A GPT-2-layout checkpoint: Conv1D weights stored [d_in, d_out] (``h.N.attn.c_attn.weight`` ...)."""
    out = Path(out)
    gen = torch.Generator().manual_seed(seed)
    config = {
        "model_type": "gpt2",
        "n_embd": n_embd,
        "n_layer": layers,
        "n_head": 4,
        "n_inner": None,
        "vocab_size": 100,
        "n_positions": 64,
    }
    tensors: dict[str, torch.Tensor] = {
        "wte.weight": torch.randn(100, n_embd, generator=gen).to(dtype),
        "wpe.weight": torch.randn(64, n_embd, generator=gen).to(dtype),
    }
    shapes = {  # [d_out, d_in]; stored transposed
        "attn.c_attn": (3 * n_embd, n_embd),
        "attn.c_proj": (n_embd, n_embd),
        "mlp.c_fc": (4 * n_embd, n_embd),
        "mlp.c_proj": (n_embd, 4 * n_embd),
    }
    for layer in range(layers):
        for suffix, (d_out, d_in) in shapes.items():
            w, _ = structured_weight(d_out, d_in, gen)
            tensors[f"h.{layer}.{suffix}.weight"] = w.T.contiguous().to(dtype)
            tensors[f"h.{layer}.{suffix}.bias"] = torch.zeros(d_out, dtype=dtype)
        tensors[f"h.{layer}.ln_1.weight"] = torch.ones(n_embd, dtype=dtype)
        tensors[f"h.{layer}.ln_2.weight"] = torch.ones(n_embd, dtype=dtype)
    tensors["ln_f.weight"] = torch.ones(n_embd, dtype=dtype)
    total = _save_single(tensors, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return SyntheticCheckpoint(out, config, total_bytes=total)


def write_bert(
    out: str | Path,
    *,
    layers: int = 2,
    hidden: int = 32,
    intermediate: int = 96,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> SyntheticCheckpoint:
    """A BERT-layout checkpoint (``bert.encoder.layer.N.attention.self.query.weight`` ...) + config.json."""
    out = Path(out)
    gen = torch.Generator().manual_seed(seed)
    config = {
        "model_type": "bert",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "vocab_size": 50,
    }
    tensors: dict[str, torch.Tensor] = {
        "bert.embeddings.word_embeddings.weight": torch.randn(50, hidden, generator=gen).to(dtype),
        "bert.pooler.dense.weight": torch.randn(hidden, hidden, generator=gen).to(dtype),
    }
    shapes = {
        "attention.self.query": (hidden, hidden),
        "attention.self.key": (hidden, hidden),
        "attention.self.value": (hidden, hidden),
        "attention.output.dense": (hidden, hidden),
        "intermediate.dense": (intermediate, hidden),
        "output.dense": (hidden, intermediate),
    }
    for layer in range(layers):
        for suffix, (d_out, d_in) in shapes.items():
            w, _ = structured_weight(d_out, d_in, gen)
            tensors[f"bert.encoder.layer.{layer}.{suffix}.weight"] = w.to(dtype)
            tensors[f"bert.encoder.layer.{layer}.{suffix}.bias"] = torch.zeros(d_out, dtype=dtype)
        tensors[f"bert.encoder.layer.{layer}.attention.output.LayerNorm.weight"] = torch.ones(hidden, dtype=dtype)
        tensors[f"bert.encoder.layer.{layer}.output.LayerNorm.weight"] = torch.ones(hidden, dtype=dtype)
    total = _save_single(tensors, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return SyntheticCheckpoint(out, config, total_bytes=total)


def hard_spectrum_weight(
    d_out: int,
    d_in: int,
    generator: torch.Generator,
    alpha: float = 1.0,
    outliers: int = 4,
    outlier_scale: float = 30.0,
    duplicates: int = 0,
    orthogonal: bool = True,
) -> torch.Tensor:
    """A float32 d_out x d_in weight shaped like a trained LLM layer: U diag(sigma) V^T, Haar U and V.

    sigma_i = i^-alpha, the first ``outliers`` values ``outlier_scale`` times larger; ``duplicates`` rows
    are copies of other rows plus 1e-3 relative noise (near-duplicate neurons). ``orthogonal=False`` uses
    Gaussian U and V (one float32 product, for 7B-sized benchmark layers; no duplicates): a power law, not
    exactly sigma.
    """
    n = min(d_out, d_in)
    sigma = torch.arange(1, n + 1, dtype=torch.float64) ** -float(alpha)
    sigma[:outliers] *= outlier_scale
    if not orthogonal:
        u = torch.randn(d_out, n, generator=generator) / math.sqrt(d_out)
        return (u * sigma.float()) @ (torch.randn(n, d_in, generator=generator) / math.sqrt(d_in))
    u = torch.linalg.qr(torch.randn(d_out, n, generator=generator, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(d_in, n, generator=generator, dtype=torch.float64)).Q
    w = (u * sigma) @ v.T
    if duplicates:
        idx = torch.randperm(d_out, generator=generator)[: 2 * duplicates]
        src, dst = idx[:duplicates], idx[duplicates:]
        noise = torch.randn(duplicates, d_in, generator=generator, dtype=torch.float64)
        w[dst] = w[src] + 1e-3 * noise * w[src].norm(dim=1, keepdim=True) / math.sqrt(d_in)
    return w.to(torch.float32)
