"""Model families PLATE knows: default target module types by config.json's ``model_type``, how their weights are
stored (Conv1D, 3-D expert stacks and their orientation), routers, and the config.json fields that size them.

Re-exported by :mod:`plate_inspect.targets` (import from there).
"""

from __future__ import annotations

import re
from typing import Any

#: Orientations of a stored weight: linear [d_out, d_in]; conv1d [d_in, d_out] (GPT-2); 3-D expert stacks
#: [experts, d_out, d_in] (experts_out_major) or [experts, d_in, d_out] (experts_in_major).
LAYOUTS = ("linear", "conv1d", "experts_out_major", "experts_in_major")
EXPERT_LAYOUTS = frozenset({"experts_out_major", "experts_in_major"})

_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_GLU = ("gate_proj", "up_proj", "down_proj")
_LLAMA_LIKE = (*_ATTENTION, *(f"mlp.{p}" for p in _GLU))
_MLA = (
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.q_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
)
_QWEN3_MOE = (*_LLAMA_LIKE, *(f"mlp.experts.{p}" for p in _GLU), "mlp.experts.gate_up_proj")
_DEEPSEEK = (
    *_MLA,
    *(f"mlp.{p}" for p in _GLU),
    *(f"mlp.experts.{p}" for p in _GLU),
    *(f"mlp.shared_experts.{p}" for p in _GLU),
    "mlp.experts.gate_up_proj",
    "eh_proj",  # only in the multi-token-prediction layer
)
_LLAMA4 = (
    *_ATTENTION,
    *(f"feed_forward.{p}" for p in _GLU),
    *(f"feed_forward.shared_expert.{p}" for p in _GLU),
    "feed_forward.experts.gate_up_proj",
    "feed_forward.experts.down_proj",
)

#: DeepSeek's multi-head latent attention and mixture of experts.
_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite")

_BERT = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
#: BERT's layer layout (encoder.layer.<i>.attention.self.query, ...), under the same module names.
_BERT_TYPES = ("bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra")
#: T5 / mT5 blocks (encoder.block.<i>, decoder.block.<i>: both count as layer i): self-attention in layer.0; the
#: decoder's cross-attention in layer.1; the feed-forward in layer.1 (encoder) or layer.2 (decoder), ``wi`` (ReLU)
#: or gated ``wi_0`` / ``wi_1`` (T5 v1.1, mT5). Never the relative_attention_bias (an embedding table).
_T5 = (
    *(f"layer.0.SelfAttention.{p}" for p in "qkvo"),
    *(f"layer.1.EncDecAttention.{p}" for p in "qkvo"),
    *(f"layer.{i}.DenseReluDense.{p}" for i in (1, 2) for p in ("wi", "wi_0", "wi_1", "wo")),
)

#: T5-style encoder-decoders (T5 v1.0/v1.1, mT5, umT5: umT5 has a relative_attention_bias in every block).
_T5_TYPES = ("t5", "mt5", "umt5")
#: BART-style encoder-decoders (encoder.layers.<i>, decoder.layers.<i>: both count as layer i); encoder_attn is the
#: decoder's cross-attention.
_BART = (
    *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")),
    *(f"encoder_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")),
    "fc1",
    "fc2",
)
_BART_TYPES = ("bart", "mbart")

#: Llama's attention and GLU under their names; families with only up/down (Nemotron, Apertus, Arcee) match a subset.
_LLAMA_LIKE_TYPES = (
    *("llama", "qwen2", "qwen3", "mistral", "ministral", "gemma", "gemma2", "gemma3", "gemma3_text", "olmo", "olmo2"),
    *("olmo3", "smollm3", "cohere", "cohere2", "seed_oss", "exaone4", "granite", "apertus", "arcee", "nemotron"),
    *("ernie4_5", "hunyuan_v1_dense", "gemma3n", "gemma3n_text"),
    # vision-language models whose language model is Llama-like (their config.json flat, or with text_config)
    *("qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text", "qwen3_vl", "qwen3_vl_text"),
)
#: GLM-4: Llama's attention, a fused gate_up_proj [2 x intermediate, hidden].
_GLM = (*_ATTENTION, "mlp.gate_up_proj", "mlp.down_proj")
_GLM_TYPES = ("glm", "glm4", "glm4v", "glm4v_text")
#: DeepSeek-style mixture of experts under Llama's attention: dense first layers (first_k_dense_replace), routed
#: experts one tensor per expert, shared experts (GLM-4.5, dots.llm1, ERNIE-4.5-MoE).
_SHARED_EXPERTS_MOE = (
    *_LLAMA_LIKE,
    *(f"mlp.experts.{p}" for p in _GLU),
    *(f"mlp.shared_experts.{p}" for p in _GLU),
    "mlp.experts.gate_up_proj",
    "eh_proj",  # GLM-4.5's multi-token-prediction layer (DeepSeek-V3's layout), scanned with include_mtp
)
_SHARED_EXPERTS_MOE_TYPES = ("glm4_moe", "glm4v_moe", "glm4v_moe_text", "dots1", "ernie4_5_moe")
#: Mixtral's routed experts (block_sparse_moe.experts.<e>.w1/w2/w3, or transformers 5's fused stacks).
_MIXTRAL_EXPERTS = (
    *(f"block_sparse_moe.experts.{w}" for w in ("w1", "w2", "w3")),
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
)
#: Granite MoE: all experts of a layer in two 3-D tensors, block_sparse_moe.input_linear [E, 2 x inter, hidden]
#: and output_linear [E, hidden, inter]; shared experts shared_mlp.input_linear / output_linear; Granite-4.0-H's
#: Mamba-2 layers mamba.in_proj / out_proj.
_GRANITE_MOE = (
    *_ATTENTION,
    "block_sparse_moe.input_linear",
    "block_sparse_moe.output_linear",
    "shared_mlp.input_linear",
    "shared_mlp.output_linear",
    "mamba.in_proj",
    "mamba.out_proj",
)
_GRANITE_MOE_TYPES = ("granitemoe", "granitemoeshared", "granitemoehybrid")

#: Default target module types (the module name after its layer index, expert index removed) by model_type.
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    **{t: _LLAMA_LIKE for t in _LLAMA_LIKE_TYPES},
    **{t: _GLM for t in _GLM_TYPES},
    **{t: _SHARED_EXPERTS_MOE for t in _SHARED_EXPERTS_MOE_TYPES},
    **{t: _GRANITE_MOE for t in _GRANITE_MOE_TYPES},
    # Qwen3-Next: gated attention every full_attention_interval-th layer, Gated DeltaNet (linear_attn) in the others
    "qwen3_next": (
        *_QWEN3_MOE,
        *(f"mlp.shared_expert.{p}" for p in _GLU),
        *(f"linear_attn.{p}" for p in ("in_proj_qkvz", "in_proj_ba", "out_proj")),
    ),
    "olmoe": _QWEN3_MOE,
    # Jamba: Mamba layers (in_proj, x_proj, dt_proj, out_proj) with attention every attn_layer_period-th layer;
    # every expert_layer_period-th feed-forward is a mixture of experts
    "jamba": (
        *_ATTENTION,
        *(f"feed_forward.{p}" for p in _GLU),
        *(f"feed_forward.experts.{p}" for p in _GLU),
        "feed_forward.experts.gate_up_proj",
        *(f"mamba.{p}" for p in ("in_proj", "x_proj", "dt_proj", "out_proj")),
    ),
    # Falcon-H1: attention and Mamba-2 side by side in every layer
    "falcon_h1": (*_ATTENTION, *(f"feed_forward.{p}" for p in _GLU), "mamba.in_proj", "mamba.out_proj"),
    "flex_olmo": _QWEN3_MOE,
    # LFM2: attention (out_proj) every few layers, short gated convolutions (conv.in_proj / out_proj) in the others
    "lfm2": (
        *_ATTENTION[:3],
        "self_attn.out_proj",
        "conv.in_proj",
        "conv.out_proj",
        *(f"feed_forward.{w}" for w in ("w1", "w2", "w3")),
    ),
    "hunyuan_v1_moe": (*_QWEN3_MOE, *(f"mlp.shared_mlp.{p}" for p in _GLU)),
    "phimoe": (*_ATTENTION, *_MIXTRAL_EXPERTS),
    "minimax_m2": (*_ATTENTION, *_MIXTRAL_EXPERTS),
    # MiniMax-Text-01: lightning (linear) attention layers qkv_proj / out_proj / output_gate between softmax ones
    "minimax": (*_ATTENTION, *(f"self_attn.{p}" for p in ("qkv_proj", "out_proj", "output_gate")), *_MIXTRAL_EXPERTS),
    "phi": (*_ATTENTION[:3], "self_attn.dense", "mlp.fc1", "mlp.fc2"),
    "starcoder2": (*_ATTENTION, "mlp.c_fc", "mlp.c_proj"),
    "gpt_neox": ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    "falcon": ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    "phi3": ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
    "mixtral": (*_ATTENTION, *_MIXTRAL_EXPERTS),
    "qwen2_moe": (*_QWEN3_MOE, *(f"mlp.shared_expert.{p}" for p in _GLU)),
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_vl_moe": _QWEN3_MOE,  # experts as 3-D stacks mlp.experts.gate_up_proj / down_proj
    "qwen3_vl_moe_text": _QWEN3_MOE,
    # DeepSeek-V2/V3, V3.2 (its lightning indexer's self_attn.indexer.* left out: a scorer, not a projection a
    # fine-tune adapts), GLM-4.7-Flash (glm4_moe_lite: DeepSeek's MLA and MoE)
    **{t: _DEEPSEEK for t in _DEEPSEEK_TYPES},
    "llama4": _LLAMA4,
    "llama4_text": _LLAMA4,
    "gpt_oss": (*_ATTENTION, "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    **{t: _BERT for t in _BERT_TYPES},
    "distilbert": (
        "attention.q_lin",
        "attention.k_lin",
        "attention.v_lin",
        "attention.out_lin",
        "ffn.lin1",
        "ffn.lin2",
    ),
    # DeBERTa-v2/v3: pos_key_proj / pos_query_proj exist (per layer) only with relative attention and share_att_key
    # false; the relative-position embeddings (encoder.rel_embeddings) are not a layer's module
    "deberta-v2": (
        *(f"attention.self.{p}" for p in ("query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj")),
        *_BERT[3:],
    ),
    "modernbert": ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo"),
    **{t: _T5 for t in _T5_TYPES},
    **{t: _BART for t in _BART_TYPES},
}
#: Families whose 2-D weights are stored as [d_in, d_out] (GPT-2's Conv1D).
CONV1D_FAMILIES = frozenset({"gpt2"})
#: Families whose plain 3-D expert tensors are [experts, d_in, d_out] (they multiply x @ W[e]); the others'
#: (transformers' fused gate_up_proj/down_proj parameters) are [experts, d_out, d_in]. MXFP4 ``*_blocks`` are
#: always [experts, d_out, d_in / 32, 16]: output rows first.
EXPERTS_IN_MAJOR_FAMILIES = frozenset({"llama4", "llama4_text", "gpt_oss", "qwen3_vl_moe", "qwen3_vl_moe_text"})
#: Families whose 3-D expert stacks come in either orientation: Qwen3-VL-MoE's released checkpoints store
#: [experts, d_in, d_out], transformers 5 re-saves them as its parameters, [experts, d_out, d_in]. The shapes against
#: config.json decide (gate_up_proj is square only when 2 x moe_intermediate_size = hidden_size, and then down_proj
#: is not), one orientation for the whole checkpoint.
LAYOUT_BY_SHAPE_FAMILIES = frozenset({"qwen3_vl_moe", "qwen3_vl_moe_text"})
#: Router / gate weights: never targets unless named explicitly.
ROUTER = re.compile(r"(^|\.)(gate|router|shared_expert_gate|gate\.wg|router\.layer|modality_router)$")

#: Weights that hold all experts of a layer as one 3-D tensor: any under an ``experts`` module, and Granite MoE's
#: block_sparse_moe.input_linear / output_linear.
_STACKED = re.compile(r"\.experts\.|\.block_sparse_moe\.(input|output)_linear\.weight$")
#: Where a multimodal wrapper keeps its language model (Gemma-3, LLaVA: language_model; Idefics3: text_model).
_LANGUAGE_MODEL = ("language_model.", "text_model.")

#: The Qwen mixture-of-experts families (one config layout: moe_intermediate_size, mlp_only_layers, ...).
_QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_next")
#: Families whose routed experts are Mixtral's (block_sparse_moe.experts.<e>.w1/w2/w3 of intermediate_size).
_MIXTRAL_TYPES = ("mixtral", "phimoe", "minimax", "minimax_m2")


#: config.json key holding the number of routed experts, by family.
EXPERT_COUNT_KEYS = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
    "qwen3_vl_moe": "num_experts",
    "qwen3_vl_moe_text": "num_experts",
    **{t: "n_routed_experts" for t in _DEEPSEEK_TYPES},
    "llama4": "num_local_experts",
    "llama4_text": "num_local_experts",
    "gpt_oss": "num_local_experts",
    **{t: "num_local_experts" for t in (*_MIXTRAL_TYPES, *_GRANITE_MOE_TYPES)},
    **{t: "n_routed_experts" for t in ("glm4_moe", "glm4v_moe", "glm4v_moe_text", "dots1")},
    "ernie4_5_moe": "moe_num_experts",
    **{t: "num_experts" for t in ("olmoe", "flex_olmo", "hunyuan_v1_moe", "qwen3_next", "jamba")},
}


#: config.json fields that say which decoder layers are mixture-of-experts layers (the others dense), by family, and
#: the prefix of the layer's feed-forward modules. transformers (and DeepSeek's own modeling code) build layer i as:
#:   qwen2_moe, qwen3_moe: MoE iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
#:   deepseek_v2/v3/v32, glm4_moe_lite: MoE iff n_routed_experts is not null and i >= first_k_dense_replace and
#:     i % moe_layer_freq == 0
#:   llama4: MoE iff i in moe_layers, which defaults to the i with (i + 1) % interleave_moe_layer_step == 0
#:   glm4_moe, glm4v_moe, dots1: as DeepSeek (their configs have no moe_layer_freq: 1)
#:   jamba: MoE iff num_experts > 1 and i % expert_layer_period == expert_layer_offset
#:   ernie4_5_moe: MoE iff (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index
MOE_LAYER_FIELDS: dict[str, tuple[str, ...]] = {
    **{t: ("mlp_only_layers", "decoder_sparse_step") for t in _QWEN_MOE_TYPES},
    **{t: ("first_k_dense_replace", "moe_layer_freq") for t in (*_DEEPSEEK_TYPES, "dots1")},
    **{t: ("first_k_dense_replace", "moe_layer_freq") for t in ("glm4_moe", "glm4v_moe", "glm4v_moe_text")},
    "ernie4_5_moe": ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"),
    "llama4": ("moe_layers", "interleave_moe_layer_step"),
    "llama4_text": ("moe_layers", "interleave_moe_layer_step"),
    "jamba": ("expert_layer_period", "expert_layer_offset"),
}
_FFN_PREFIX = {
    "llama4": "feed_forward.",
    "llama4_text": "feed_forward.",
    "jamba": "feed_forward.",
}  # the other families': "mlp."


#: words naming a multimodal model's non-text layer stacks (``model.vision_tower.encoder.layers``, ``visual.blocks``),
#: whose layer count is their own sub-config's (``vision_config``), not ``num_hidden_layers`` of the text model
_OTHER_TOWERS = ("vision", "visual", "image", "audio", "speech", "whisper")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` of a multimodal wrapper (Gemma-3, Llama-4), else config."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def mtp_layers(config: dict[str, Any]) -> set[int]:
    """Layer indices of DeepSeek's multi-token-prediction layers (num_hidden_layers, ...), empty otherwise."""
    c = text_config(config)
    n_mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0
    n_layers = c.get("num_hidden_layers")
    if not isinstance(n_layers, int) or not isinstance(n_mtp, int):
        return set()
    return set(range(n_layers, n_layers + n_mtp))


def model_family(config: dict[str, Any]) -> str | None:
    """The model_type whose defaults and shape checks apply: config.json's own; for a multimodal wrapper the table
    does not name (LLaVA, Mistral-3, Idefics3, PaliGemma, ...) its ``text_config``'s, when the table names that."""
    model_type = str(config.get("model_type", "")) or None
    inner = config.get("text_config")
    if model_type not in FAMILY_TARGETS and isinstance(inner, dict) and inner.get("model_type") in FAMILY_TARGETS:
        return str(inner["model_type"])
    return model_type
