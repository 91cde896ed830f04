"""Synthetic HF-style checkpoints with real names and layouts (Qwen2/Llama, GPT-2 Conv1D, BERT).

For tests and benchmarks on machines without hub access: weights have a decaying spectrum (not iid noise)
and, optionally, planted groups of near-duplicate rows whose indices are known.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from plate_inspect.model_files import INDEX_FILE


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


class ShardedWriter:
    """Collects tensors and writes them as one ``model.safetensors`` or, with ``max_shard_bytes``, as shards
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (memory: about one shard)."""

    def __init__(self, out: Path, max_shard_bytes: int | None = None) -> None:
        self.out = out
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.shards: list[str] = []
        self.total_bytes = 0
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor for the next shard (written by :meth:`flush`)."""
        self.pending[name] = tensor.contiguous()

    def flush(self, force: bool = False) -> None:
        """Write the pending tensors as the next shard once they reach max_shard_bytes (or when forced)."""
        size = sum(t.numel() * t.element_size() for t in self.pending.values())
        if not self.max_shard_bytes or not self.pending or not (force or size >= self.max_shard_bytes):
            return
        fname = f"model-{len(self.shards) + 1:05d}.safetensors"
        save_file(dict(self.pending), str(self.out / fname), metadata={"format": "pt"})
        self.weight_map.update({n: fname for n in self.pending})
        self.shards.append(fname)
        self.total_bytes += size
        self.pending.clear()

    def close(self) -> int:
        """Write what is left (and the index when sharded); returns the bytes of tensor data."""
        if not self.max_shard_bytes:
            self.total_bytes = _save_single(self.pending, self.out)
            return self.total_bytes
        self.flush(force=True)
        n = len(self.shards)
        renamed = {}
        for i, fname in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out / fname).rename(self.out / final)
            renamed[fname] = final
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: renamed[v] for k, v in self.weight_map.items()},
        }
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return self.total_bytes


def llama_config(
    model_type: str,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of a Qwen2/Llama-layout model."""
    return {
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


def llama_layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """[d_out, d_in] of the seven projections of one Llama-layout decoder layer."""
    return {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }


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
    config = llama_config(model_type, layers, hidden, intermediate, heads, kv_heads, vocab, dtype)
    gen = torch.Generator().manual_seed(seed)
    shapes = llama_layer_shapes(hidden, intermediate, heads, kv_heads, hidden // heads)
    ckpt = SyntheticCheckpoint(out, config)
    writer = ShardedWriter(out, max_shard_bytes)
    writer.add("model.embed_tokens.weight", (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype))
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for suffix, (d_out, d_in) in shapes.items():
            if spectrum_alpha is None:
                w, rows = structured_weight(d_out, d_in, gen, planted=round(planted_fraction * d_out))
            else:
                w, rows = hard_spectrum_weight(d_out, d_in, gen, alpha=spectrum_alpha, orthogonal=False), []
            writer.add(f"{prefix}.{suffix}.weight", w.to(dtype))
            if rows:
                ckpt.planted_rows[f"{prefix}.{suffix}"] = rows
        writer.add(f"{prefix}.input_layernorm.weight", torch.ones(hidden, dtype=dtype))
        writer.add(f"{prefix}.post_attention_layernorm.weight", torch.ones(hidden, dtype=dtype))
        if model_type == "qwen2":
            for proj in ("q_proj", "k_proj", "v_proj"):
                writer.add(f"{prefix}.self_attn.{proj}.bias", torch.zeros(shapes[f"self_attn.{proj}"][0], dtype=dtype))
        writer.flush()
    writer.add("model.norm.weight", torch.ones(hidden, dtype=dtype))
    writer.add("lm_head.weight", (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype))
    ckpt.total_bytes = writer.close()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


def _write_layered(
    out: Path,
    config: dict,
    layers: int,
    gen: torch.Generator,
    dtype: torch.dtype,
    head: dict[str, tuple[int, int]],
    layer_prefix: str,
    modules: dict[str, tuple[int, int]],
    norms: dict[str, int],
    tail: dict[str, int],
    conv1d: bool = False,
) -> SyntheticCheckpoint:
    """One-file checkpoint from tables: random ``head`` tensors, then per layer every module of ``modules``
    ([d_out, d_in], planted structure, a zero bias; stored [d_in, d_out] when ``conv1d``) and the ``norms`` (ones of
    the given width) under ``layer_prefix.N``, then the ``tail`` norms; config.json beside it."""
    out = Path(out)
    tensors = {name: torch.randn(*shape, generator=gen).to(dtype) for name, shape in head.items()}
    for layer in range(layers):
        prefix = f"{layer_prefix}.{layer}"
        for suffix, (d_out, d_in) in modules.items():
            w, _ = structured_weight(d_out, d_in, gen)
            tensors[f"{prefix}.{suffix}.weight"] = (w.T.contiguous() if conv1d else w).to(dtype)
            tensors[f"{prefix}.{suffix}.bias"] = torch.zeros(d_out, dtype=dtype)
        tensors.update({f"{prefix}.{norm}.weight": torch.ones(width, dtype=dtype) for norm, width in norms.items()})
    tensors.update({f"{norm}.weight": torch.ones(width, dtype=dtype) for norm, width in tail.items()})
    total = _save_single(tensors, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return SyntheticCheckpoint(out, config, total_bytes=total)


def write_gpt2(
    out: str | Path, *, layers: int = 2, n_embd: int = 48, dtype: torch.dtype = torch.float32, seed: int = 0
) -> SyntheticCheckpoint:
    """A GPT-2-layout checkpoint: Conv1D weights stored [d_in, d_out] (``h.N.attn.c_attn.weight`` ...)."""
    config = {
        "model_type": "gpt2",
        "n_embd": n_embd,
        "n_layer": layers,
        "n_head": 4,
        "n_inner": None,
        "vocab_size": 100,
        "n_positions": 64,
    }
    modules = {  # [d_out, d_in]; stored transposed
        "attn.c_attn": (3 * n_embd, n_embd),
        "attn.c_proj": (n_embd, n_embd),
        "mlp.c_fc": (4 * n_embd, n_embd),
        "mlp.c_proj": (n_embd, 4 * n_embd),
    }
    head = {"wte.weight": (100, n_embd), "wpe.weight": (64, n_embd)}
    norms = {"ln_1": n_embd, "ln_2": n_embd}
    gen = torch.Generator().manual_seed(seed)
    tail = {"ln_f": n_embd}
    return _write_layered(Path(out), config, layers, gen, dtype, head, "h", modules, norms, tail, conv1d=True)


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
    config = {
        "model_type": "bert",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "vocab_size": 50,
    }
    modules = {
        "attention.self.query": (hidden, hidden),
        "attention.self.key": (hidden, hidden),
        "attention.self.value": (hidden, hidden),
        "attention.output.dense": (hidden, hidden),
        "intermediate.dense": (intermediate, hidden),
        "output.dense": (hidden, intermediate),
    }
    head = {"bert.embeddings.word_embeddings.weight": (50, hidden), "bert.pooler.dense.weight": (hidden, hidden)}
    norms = {"attention.output.LayerNorm": hidden, "output.LayerNorm": hidden}
    gen = torch.Generator().manual_seed(seed)
    return _write_layered(Path(out), config, layers, gen, dtype, head, "bert.encoder.layer", modules, norms, {})


# --------------------------------------------------------------------------- model families (real names, small dims)
#: Small default dimensions per family (config.json keys as the family's transformers config names them).
FAMILY_DEFAULTS: dict[str, dict] = {
    "llama": {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 1},
    "qwen3": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
    },
    "olmo2": {"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4, "num_key_value_heads": 4},
    "phi3": {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gemma3": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
    },
    "mixtral": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    "qwen3_moe": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_vl_moe": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 20,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    "deepseek_v3": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1,
    },
    "deepseek_v2": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 3,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "first_k_dense_replace": 1,
    },
    "llama4": {
        "hidden_size": 32,
        "intermediate_size": 24,
        "intermediate_size_mlp": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 3,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
    },
    "gpt_oss": {
        "hidden_size": 96,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
    },
}
#: Families whose text model sits inside a multimodal wrapper (config.text_config, weights under language_model.).
MULTIMODAL = {"gemma3": "gemma3_text", "llama4": "llama4_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
#: Where the language model's layers sit in each family's checkpoint.
MODEL_ROOT = {
    "gemma3": "language_model.model",
    "llama4": "language_model.model",
    "qwen3_vl_moe": "model.language_model",
}
#: Where the families' one-layer vision towers sit (never default targets).
VISION_LAYER = {
    "gemma3": "vision_tower.vision_model.encoder.layers.0",
    "llama4": "vision_model.model.layers.0",
    "qwen3_vl_moe": "model.visual.blocks.0",
}


class _LayerBuilder:
    """Generates one family's tensors with their real names: structured weights, ones for norms, zero biases."""

    def __init__(self, gen: torch.Generator, dtype: torch.dtype, fp8: bool = False, mxfp4: bool = False) -> None:
        self.gen = gen
        self.dtype = dtype
        self.fp8 = fp8  # linear weights as float8_e4m3fn with 128x128 block weight_scale_inv (DeepSeek-V3 release)
        self.mxfp4 = mxfp4  # 3-D expert stacks as MXFP4 *_blocks / *_scales (gpt-oss release)
        self.tensors: dict[str, torch.Tensor] = {}

    def linear(self, name: str, d_out: int, d_in: int, bias: bool = False) -> None:
        w = structured_weight(d_out, d_in, self.gen)[0]
        if self.fp8:  # W = W_fp8 * weight_scale_inv, one scale per 128 x 128 block
            scale = torch.rand(-(-d_out // 128), -(-d_in // 128), generator=self.gen) * 1e-3 + 1e-3
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:d_out, :d_in]
            fp8_max = torch.finfo(torch.float8_e4m3fn).max  # saturate: torch 2.2 casts 464+ to NaN
            self.tensors[f"{name}.weight"] = (w / full).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            self.tensors[f"{name}.weight_scale_inv"] = scale
        else:
            self.tensors[f"{name}.weight"] = w.to(self.dtype)
        if bias:
            self.tensors[f"{name}.bias"] = (torch.randn(d_out, generator=self.gen) * 0.01).to(self.dtype)

    def vector(self, name: str, n: int, value: float = 1.0) -> None:
        self.tensors[name] = torch.full((n,), value, dtype=self.dtype)

    def router(self, name: str, experts: int, hidden: int) -> None:
        self.tensors[f"{name}.weight"] = (torch.randn(experts, hidden, generator=self.gen) * 0.1).to(self.dtype)

    def glu(
        self, prefix: str, inter: int, hidden: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    ) -> None:
        gate, up, down = names
        self.linear(f"{prefix}.{gate}", inter, hidden)
        self.linear(f"{prefix}.{up}", inter, hidden)
        self.linear(f"{prefix}.{down}", hidden, inter)

    def stack(self, name: str, experts: int, d_out: int, d_in: int, in_major: bool) -> None:
        """``experts`` weights [d_out, d_in] stored as one 3-D tensor ([E, d_in, d_out] when in_major); with
        mxfp4, as ``<name>_blocks`` [E, d_out, d_in / 32, 16] and ``<name>_scales`` [E, d_out, d_in / 32] (uint8)."""
        if self.mxfp4:
            blocks = torch.randint(0, 256, (experts, d_out, d_in // 32, 16), generator=self.gen, dtype=torch.uint8)
            scales = torch.randint(120, 128, (experts, d_out, d_in // 32), generator=self.gen, dtype=torch.uint8)
            self.tensors[f"{name}_blocks"], self.tensors[f"{name}_scales"] = blocks, scales
            return
        ws = [structured_weight(d_out, d_in, self.gen)[0] for _ in range(experts)]
        stacked = torch.stack([w.T if in_major else w for w in ws])
        self.tensors[name] = stacked.contiguous().to(self.dtype)

    def attention(self, prefix: str, c: dict, bias: bool = False, qk_norm: int = 0) -> None:
        h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or h // heads
        self.linear(f"{prefix}.q_proj", heads * hd, h, bias)
        self.linear(f"{prefix}.k_proj", kv * hd, h, bias)
        self.linear(f"{prefix}.v_proj", kv * hd, h, bias)
        self.linear(f"{prefix}.o_proj", h, heads * hd, bias and c.get("model_type") == "gpt_oss")
        if qk_norm:
            self.vector(f"{prefix}.q_norm.weight", qk_norm)
            self.vector(f"{prefix}.k_norm.weight", qk_norm)

    def mla(self, prefix: str, c: dict) -> None:
        """DeepSeek's multi-head latent attention (q_lora_rank None: a plain q_proj)."""
        h, heads = c["hidden_size"], c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        if c["q_lora_rank"] is None:
            self.linear(f"{prefix}.q_proj", heads * qk, h)
        else:
            self.linear(f"{prefix}.q_a_proj", c["q_lora_rank"], h)
            self.vector(f"{prefix}.q_a_layernorm.weight", c["q_lora_rank"])
            self.linear(f"{prefix}.q_b_proj", heads * qk, c["q_lora_rank"])
        self.linear(f"{prefix}.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
        self.vector(f"{prefix}.kv_a_layernorm.weight", c["kv_lora_rank"])
        self.linear(f"{prefix}.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        self.linear(f"{prefix}.o_proj", h, heads * c["v_head_dim"])


def _decoder_layer(b: _LayerBuilder, family: str, c: dict, prefix: str, layer: int) -> None:
    """One decoder layer of ``family`` under ``prefix`` (e.g. model.layers.3)."""
    h = c["hidden_size"]
    b.vector(f"{prefix}.input_layernorm.weight", h)
    b.vector(f"{prefix}.post_attention_layernorm.weight", h)
    if family == "phi3":
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = h // heads
        b.linear(f"{prefix}.self_attn.qkv_proj", (heads + 2 * kv) * hd, h)
        b.linear(f"{prefix}.self_attn.o_proj", h, heads * hd)
        b.linear(f"{prefix}.mlp.gate_up_proj", 2 * c["intermediate_size"], h)
        b.linear(f"{prefix}.mlp.down_proj", h, c["intermediate_size"])
        return
    if family.startswith("deepseek"):
        b.mla(f"{prefix}.self_attn", c)
        if layer < c["first_k_dense_replace"]:
            b.glu(f"{prefix}.mlp", c["intermediate_size"], h)
            return
        n, moe = c["n_routed_experts"], c["moe_intermediate_size"]
        b.router(f"{prefix}.mlp.gate", n, h)
        if family == "deepseek_v3":
            b.tensors[f"{prefix}.mlp.gate.e_score_correction_bias"] = torch.zeros(n, dtype=torch.float32)
        for e in range(n):
            b.glu(f"{prefix}.mlp.experts.{e}", moe, h)
        b.glu(f"{prefix}.mlp.shared_experts", moe * c["n_shared_experts"], h)
        return
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    qk_norm = {"qwen3": head_dim, "qwen3_moe": head_dim, "qwen3_vl_moe": head_dim, "gemma3": head_dim}.get(family, 0)
    if family == "olmo2":
        qk_norm = c["num_attention_heads"] * head_dim
    b.attention(f"{prefix}.self_attn", c, bias=family in ("qwen2_moe", "gpt_oss"), qk_norm=qk_norm)
    if family == "olmo2":  # k_norm spans the k heads
        b.vector(f"{prefix}.self_attn.k_norm.weight", c["num_key_value_heads"] * head_dim)
    if family == "gemma3":
        b.vector(f"{prefix}.pre_feedforward_layernorm.weight", h)
        b.vector(f"{prefix}.post_feedforward_layernorm.weight", h)
    if family == "mixtral":
        n, i = c["num_local_experts"], c["intermediate_size"]
        b.router(f"{prefix}.block_sparse_moe.gate", n, h)
        for e in range(n):
            b.glu(f"{prefix}.block_sparse_moe.experts.{e}", i, h, ("w1", "w3", "w2"))
    elif family in ("qwen2_moe", "qwen3_moe"):
        if layer in c["mlp_only_layers"]:
            b.glu(f"{prefix}.mlp", c["intermediate_size"], h)
            return
        n, moe = c["num_experts"], c["moe_intermediate_size"]
        b.router(f"{prefix}.mlp.gate", n, h)
        for e in range(n):
            b.glu(f"{prefix}.mlp.experts.{e}", moe, h)
        if family == "qwen2_moe":
            b.glu(f"{prefix}.mlp.shared_expert", c["shared_expert_intermediate_size"], h)
            b.router(f"{prefix}.mlp.shared_expert_gate", 1, h)
    elif family == "qwen3_vl_moe":  # the release's layout: stacks [E, d_in, d_out] (gate_up: [E, hidden, 2 x moe])
        if layer in c["mlp_only_layers"]:
            b.glu(f"{prefix}.mlp", c["intermediate_size"], h)
            return
        n, moe = c["num_experts"], c["moe_intermediate_size"]
        b.router(f"{prefix}.mlp.gate", n, h)
        b.stack(f"{prefix}.mlp.experts.gate_up_proj", n, 2 * moe, h, in_major=True)
        b.stack(f"{prefix}.mlp.experts.down_proj", n, h, moe, in_major=True)
    elif family == "llama4":
        if (layer + 1) % c["interleave_moe_layer_step"] != 0:
            b.glu(f"{prefix}.feed_forward", c["intermediate_size_mlp"], h)
            return
        n, i = c["num_local_experts"], c["intermediate_size"]
        b.router(f"{prefix}.feed_forward.router", n, h)
        b.stack(f"{prefix}.feed_forward.experts.gate_up_proj", n, 2 * i, h, in_major=True)
        b.stack(f"{prefix}.feed_forward.experts.down_proj", n, h, i, in_major=True)
        b.glu(f"{prefix}.feed_forward.shared_expert", i, h)
    elif family == "gpt_oss":
        n, i = c["num_local_experts"], c["intermediate_size"]
        b.tensors[f"{prefix}.self_attn.sinks"] = torch.zeros(c["num_attention_heads"], dtype=b.dtype)
        b.router(f"{prefix}.mlp.router", n, h)
        b.tensors[f"{prefix}.mlp.router.bias"] = torch.zeros(n, dtype=b.dtype)
        b.stack(f"{prefix}.mlp.experts.gate_up_proj", n, 2 * i, h, in_major=True)
        b.tensors[f"{prefix}.mlp.experts.gate_up_proj_bias"] = torch.zeros(n, 2 * i, dtype=b.dtype)
        b.stack(f"{prefix}.mlp.experts.down_proj", n, h, i, in_major=True)
        b.tensors[f"{prefix}.mlp.experts.down_proj_bias"] = torch.zeros(n, h, dtype=b.dtype)
    else:
        b.glu(f"{prefix}.mlp", c["intermediate_size"], h)


def family_config(family: str, layers: int, vocab: int, dtype: torch.dtype, **overrides: Any) -> dict:
    """config.json for ``family``: small default dims (:data:`FAMILY_DEFAULTS`), multimodal ones wrapped."""
    text = {"model_type": MULTIMODAL.get(family, family), **FAMILY_DEFAULTS[family], **overrides}
    text.update(num_hidden_layers=layers, vocab_size=vocab, rms_norm_eps=1e-6)
    if family not in MULTIMODAL:
        return {**text, "torch_dtype": str(dtype).removeprefix("torch.")}
    vision = {"model_type": f"{family}_vision_model", "hidden_size": 16, "intermediate_size": 24}
    return {"model_type": family, "text_config": text, "vision_config": vision}


def write_family(
    out: str | Path,
    family: str,
    *,
    layers: int = 2,
    vocab: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    fp8: bool = False,
    mxfp4: bool = False,
    max_shard_bytes: int | None = None,
    **overrides: Any,
) -> SyntheticCheckpoint:
    """A checkpoint of ``family`` (a key of :data:`FAMILY_DEFAULTS`) with its real tensor names and config keys.

    Mixtral/Qwen-MoE/DeepSeek store one 2-D tensor per expert; Llama-4, gpt-oss and Qwen3-VL-MoE store each
    projection's experts as one 3-D tensor [experts, d_in, d_out] (as their bf16 releases do; gpt-oss with biases).
    Routers, norms, biases, embeddings and heads are there too, as are DeepSeek's multi-token-prediction layer (index
    ``layers``), the vision towers of Gemma-3, Llama-4 and Qwen3-VL-MoE and their language models' prefixes. ``fp8``
    stores linear weights as DeepSeek-V3's release does (float8_e4m3fn + 128x128 ``weight_scale_inv``), ``mxfp4`` stores
    expert stacks as gpt-oss's release does (``*_blocks`` + ``*_scales``); both add the release's
    ``quantization_config`` to config.json. ``max_shard_bytes``: shards + index.json, tensors in name order (a
    weight and its scale may land in different shards, as in any sharded release).
    """
    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILY_DEFAULTS)}")
    out = Path(out)
    config = family_config(family, layers, vocab, dtype, **overrides)
    c = config.get("text_config", config)
    b = _LayerBuilder(torch.Generator().manual_seed(seed), dtype, fp8=fp8, mxfp4=mxfp4)
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if mxfp4:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    root = MODEL_ROOT.get(family, "model")
    h = c["hidden_size"]
    b.tensors[f"{root}.embed_tokens.weight"] = (torch.randn(vocab, h, generator=b.gen) * 0.02).to(dtype)
    for layer in range(layers):
        _decoder_layer(b, family, c, f"{root}.layers.{layer}", layer)
    for layer in range(layers, layers + (c.get("num_nextn_predict_layers") or 0)):  # DeepSeek MTP
        prefix = f"{root}.layers.{layer}"
        _decoder_layer(b, family, c, prefix, layer)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            b.vector(f"{prefix}.{norm}.weight", h)
        b.linear(f"{prefix}.eh_proj", h, 2 * h)
        b.tensors[f"{prefix}.embed_tokens.weight"] = b.tensors[f"{root}.embed_tokens.weight"].clone()
        b.tensors[f"{prefix}.shared_head.head.weight"] = (torch.randn(vocab, h, generator=b.gen) * 0.02).to(dtype)
    b.vector(f"{root}.norm.weight", h)
    head = {"gemma3": "language_model.lm_head", "llama4": "language_model.lm_head"}.get(family, "lm_head")
    b.tensors[f"{head}.weight"] = (torch.randn(vocab, h, generator=b.gen) * 0.02).to(dtype)
    if family in MULTIMODAL:  # a one-layer vision tower whose projections must never be default targets
        vision = VISION_LAYER[family]
        b.attention(f"{vision}.self_attn", {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2})
        b.linear(f"{vision}.mlp.fc1", 24, 16, bias=True)
        b.linear(f"{vision}.mlp.fc2", 16, 24, bias=True)
        b.linear("multi_modal_projector.linear_1", h, 16)
    writer = ShardedWriter(out, max_shard_bytes)
    for name in sorted(b.tensors):
        writer.add(name, b.tensors[name])
        writer.flush()
    total = writer.close()
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
