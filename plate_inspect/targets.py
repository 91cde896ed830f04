"""Which weights of a checkpoint PLATE adapts: default targets per model family, matching, layouts, shape checks.

A target is one d_out x d_in matrix. Most are a 2-D ``<module>.weight`` tensor. Mixture-of-experts checkpoints
that store all experts of a projection as one 3-D tensor (Llama-4, gpt-oss, transformers-5 fused layouts) give
one target per expert, named ``<tensor>.<e>`` (e.g. ``model.layers.3.feed_forward.experts.gate_up_proj.17``);
checkpoints with one tensor per expert (Mixtral, Qwen-MoE, DeepSeek) keep their own names. Routers and gates
are never default targets; name them with ``target_modules`` to scan them.

Layer selections and the layer, stack and expert parts of module names live in :mod:`plate_inspect.layer_selection`
(re-exported here).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from plate_inspect.checkpoint import Checkpoint, TensorInfo, refuse_adapter
from plate_inspect.errors import CheckpointError, ConfigError, CorruptCheckpointError
from plate_inspect.layer_selection import (
    LayerEntry,
    expert_of,
    format_layers,
    layer_entries,
    layer_entry,
    layer_list,
    layer_of,
    layer_rows,
    layers_there,
    module_type_of,
    parse_layers,
    select_layers,
    span,
    split_expert,
    stack_of,
)

#: The module's own names, and the layer-selection names it re-exports (:mod:`plate_inspect.layer_selection`).
__all__ = [
    "LAYOUTS",
    "EXPERT_LAYOUTS",
    "FAMILY_TARGETS",
    "CONV1D_FAMILIES",
    "EXPERTS_IN_MAJOR_FAMILIES",
    "LAYOUT_BY_SHAPE_FAMILIES",
    "ROUTER",
    "TargetModule",
    "load_target",
    "target_matches",
    "name_list",
    "check_target_patterns",
    "text_config",
    "mtp_layers",
    "model_family",
    "select_targets",
    "unmatched_target_patterns",
    "check_weight_ranks",
    "check_layer_count",
    "expected_shapes",
    "EXPERT_COUNT_KEYS",
    "expected_experts",
    "check_shape_against_config",
    "check_expert_counts",
    "MOE_LAYER_FIELDS",
    "MoeLayerRule",
    "moe_layer_rule",
    "check_moe_layers",
    "modules_by_name",
    "LayerEntry",
    "parse_layers",
    "layer_entry",
    "layer_list",
    "layer_entries",
    "format_layers",
    "select_layers",
    "layers_there",
    "split_expert",
    "module_type_of",
    "expert_of",
    "layer_of",
    "stack_of",
    "layer_rows",
]

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
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
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
_NEVER_BY_DEFAULT = re.compile(r"(embed|lm_head|wte|wpe|norm|ln_|layernorm|pooler|classifier|score|head)", re.I)
_REGEX_CHARS = re.compile(r"[\\^$*+?()\[\]{}|]")
#: Weights that hold all experts of a layer as one 3-D tensor: any under an ``experts`` module, and Granite MoE's
#: block_sparse_moe.input_linear / output_linear.
_STACKED = re.compile(r"\.experts\.|\.block_sparse_moe\.(input|output)_linear\.weight$")
#: Where a multimodal wrapper keeps its language model (Gemma-3, LLaVA: language_model; Idefics3: text_model).
_LANGUAGE_MODEL = ("language_model.", "text_model.")
#: Tensors that are never weights of their own: quantization companions, biases, router score biases.
_COMPANION = re.compile(r"(_scale_inv|_scales|\.scales|_bias|\.bias|\.qzeros|\.g_idx|_zeros|\.input_scale)$")


@dataclass(frozen=True)
class TargetModule:
    """One weight matrix that PLATE adapts, oriented as d_out x d_in (one expert's slice of a 3-D stack)."""

    name: str  # module name, e.g. model.layers.0.self_attn.q_proj, or <tensor>.<e> for a 3-D expert slice
    tensor: TensorInfo  # the stored tensor holding the weight (MXFP4: its *_blocks)
    layout: str  # one of LAYOUTS
    layer: int | None
    module_type: str  # name after the layer index, expert index removed, e.g. mlp.experts.gate_proj
    expert: int | None = None  # expert index (per-expert tensors and 3-D slices); None for dense modules
    weight_name: str = ""  # logical weight passed to Checkpoint.read_weight ('' = tensor.name)
    weight_shape: tuple[int, ...] = ()  # logical (dequantized) shape of that weight (() = tensor.shape)
    scale_nbytes: int = 0  # stored bytes of its scales (FP8 scales, MXFP4 scales), all experts of a stack together

    @property
    def logical_name(self) -> str:
        """The weight :meth:`Checkpoint.read_weight` reads for this module."""
        return self.weight_name or self.tensor.name

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """That weight's logical (dequantized) shape, all experts of a 3-D stack included."""
        return tuple(self.weight_shape or self.tensor.shape)

    @property
    def shape(self) -> tuple[int, int]:
        """[d_out, d_in], whatever the stored layout."""
        a, b = self.logical_shape[-2:]
        return (b, a) if self.layout in ("conv1d", "experts_in_major") else (a, b)

    @property
    def nbytes(self) -> int:
        """Stored bytes of this module, scales included (one expert's share of a 3-D stack)."""
        stored = self.tensor.nbytes + self.scale_nbytes
        return stored // self.logical_shape[0] if self.layout in EXPERT_LAYOUTS else stored


def load_target(ckpt: Checkpoint, target: TargetModule) -> tuple[torch.Tensor, str]:
    """The target's weight oriented d_out x d_in (a view, stored or dequantized dtype) and its fingerprint.

    For an expert of a 3-D stack only that expert's bytes are read, and the fingerprint covers them alone.
    """
    expert = target.expert if target.layout in EXPERT_LAYOUTS else None
    stored, fingerprint = ckpt.read_weight(target.logical_name, expert=expert)
    return (stored.T if target.layout in ("conv1d", "experts_in_major") else stored), fingerprint


def _matches(module: str, pattern: str) -> bool:
    if _REGEX_CHARS.search(pattern):
        try:
            return re.fullmatch(pattern, module) is not None or re.search(pattern, module) is not None
        except re.error as e:
            raise _bad_pattern(pattern, e) from None
    return module == pattern or module.endswith("." + pattern)


def target_matches(target: TargetModule, patterns: str | Iterable[str]) -> bool:
    """Does any ``--target-modules`` pattern select ``target``: by module name, by its weight's name (a 3-D expert
    stack) or by module type, each as an exact name, a dotted suffix or a regex (peft's rules); one string is one
    pattern."""
    names = (target.name, target.logical_name.removesuffix(".weight"), target.module_type)
    return any(_matches(n, p) for p in name_list(patterns) for n in names)


def name_list(names: str | Iterable[str], argument: str = "names") -> list[str]:
    """Module, parameter or pattern names as a list; one string is one name (iterating it would give one-character
    names: ``"10"`` would pick layers 1 and 0, ``"q_proj"`` the patterns q, _, p, ...). Anything else (a number,
    None, bytes, a list holding a non-string) is a ConfigError naming ``argument``: bytes would be read as numbers."""
    if isinstance(names, str):
        return [names]
    items = None if isinstance(names, (bytes, bytearray)) or not isinstance(names, Iterable) else list(names)
    if items is None or not all(isinstance(name, str) for name in items):
        raise ConfigError(f"{argument} must be a name or a list of names, got {names!r:.80}")
    return items


def check_target_patterns(patterns: str | Iterable[str] | None) -> None:
    """ConfigError for a target-module pattern that looks like a regex but does not compile (``--target-modules '['``);
    call it before any slow work: matching raises the same error, later. One string is one pattern."""
    for pattern in name_list(patterns) if patterns else ():
        if _REGEX_CHARS.search(pattern):
            try:
                re.compile(pattern)
            except re.error as e:
                raise _bad_pattern(pattern, e) from None


def _bad_pattern(pattern: str, e: re.error) -> ConfigError:
    return ConfigError(
        f"--target-modules: '{pattern}' is not a valid regular expression ({e}); "
        "give module names (q_proj,v_proj) or a valid regex (escape literal characters with \\)"
    )


# --------------------------------------------------------------------------- logical weights
@dataclass(frozen=True)
class _Weight:
    """A weight as the scanner sees it: its logical name and shape, and the tensor whose bytes hold it."""

    module: str  # module name (logical name without '.weight')
    name: str  # logical weight name for Checkpoint.read_weight
    shape: tuple[int, ...]
    tensor: TensorInfo
    scale_nbytes: int = 0


def _matrix_weights(ckpt: Checkpoint) -> list[_Weight]:
    """Every 2-D or 3-D weight of the checkpoint, from :meth:`Checkpoint.logical_weights` (quantization companions
    already folded in: MXFP4 ``X_blocks`` + ``X_scales`` is the weight X), biases and 1-D tensors left out.

    Plain 3-D tensors count only under an ``experts`` module (stacked experts).
    """
    out = []
    for name, weight in ckpt.logical_weights().items():
        if _COMPANION.search(name):
            continue
        info = ckpt.tensors[weight.parts[0]]
        scales = sum(ckpt.tensors[p].nbytes for p in weight.parts[1:])
        module = name.removesuffix(".weight")  # a 2-D MXFP4 'X.weight_blocks' is the weight of module X too
        if weight.format == "mxfp4":
            if len(weight.shape) in (2, 3):
                out.append(_Weight(module, name, tuple(weight.shape), info, scales))
            continue
        plain = len(weight.shape) == 2 and name.endswith(".weight")
        stacked = len(weight.shape) == 3 and _STACKED.search(name) is not None
        if plain or stacked:
            out.append(_Weight(module, name, tuple(weight.shape), info, scales))
    return out


# --------------------------------------------------------------------------- selection
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


def _in_other_tower(name: str) -> bool:
    """Does a module sit in a multimodal model's vision or audio stack (``visual.blocks.3``, ``vision_tower...``)?"""
    where = stack_of(name)
    return where is not None and any(tower in where[0].lower() for tower in _OTHER_TOWERS)


def _expert_layout(model_type: str | None, weight: _Weight) -> str:
    if weight.tensor.name.endswith("_blocks"):
        return "experts_out_major"
    return "experts_in_major" if model_type in EXPERTS_IN_MAJOR_FAMILIES else "experts_out_major"


def _modules_of(weight: _Weight, model_type: str | None) -> list[TargetModule]:
    """The target modules one weight holds: itself, or one per expert of a 3-D stack."""
    layer = layer_of(weight.module)
    weight_name = weight.name if weight.name != weight.tensor.name else ""
    weight_shape = weight.shape if weight.shape != tuple(weight.tensor.shape) else ()
    if len(weight.shape) == 3:
        layout = _expert_layout(model_type, weight)
        mtype = module_type_of(weight.module)
        return [
            TargetModule(
                f"{weight.module}.{e}",
                weight.tensor,
                layout,
                layer,
                mtype,
                e,
                weight_name,
                weight_shape,
                weight.scale_nbytes,
            )
            for e in range(weight.shape[0])
        ]
    layout = "conv1d" if model_type in CONV1D_FAMILIES else "linear"
    mtype = module_type_of(weight.module)
    return [
        TargetModule(
            weight.module,
            weight.tensor,
            layout,
            layer,
            mtype,
            expert_of(weight.module),
            weight_name,
            weight_shape,
            weight.scale_nbytes,
        )
    ]


def _tied_head_hint(ckpt: Checkpoint, target_modules: list[str] | None) -> str:
    """Why an asked-for lm_head is not there: a model with tied embeddings stores its head once, as the embedding."""
    if not any("lm_head" in p for p in target_modules or []) or any("lm_head" in n for n in ckpt.tensors):
        return ""
    embeddings = sorted(n.removesuffix(".weight") for n in ckpt.tensors if n.endswith("embed_tokens.weight"))
    if not embeddings:
        return ""
    return (
        f"; this checkpoint stores no lm_head: its output head is tied to the input embedding, stored once as "
        f"'{embeddings[0]}' (name that to scan it)"
    )


def _weight_suffix_hint(patterns: list[str]) -> str:
    """A pattern copied from a tensor listing (``...q_proj.weight``) names a parameter; modules are matched."""
    return "; give module names without '.weight'" if any(p.endswith(".weight") for p in patterns) else ""


def _stack_layout_by_shape(
    candidates: list[TargetModule], shapes: dict[str, tuple[int, int] | None]
) -> list[TargetModule]:
    """Plain 3-D expert stacks oriented by their shapes against config.json (:data:`LAYOUT_BY_SHAPE_FAMILIES`): the
    orientation every stack whose shape decides it agrees on. Undecided (no config dims) or contradictory: left as
    they are, for the shape check to name the tensor that does not fit."""
    votes = set()
    for t in candidates:
        want = shapes.get(t.module_type)
        if t.layout not in EXPERT_LAYOUTS or t.tensor.name.endswith("_blocks") or want is None:
            continue
        stored = tuple(t.logical_shape[-2:])
        if stored == want and stored != want[::-1]:
            votes.add("experts_out_major")
        elif stored == want[::-1] and stored != want:
            votes.add("experts_in_major")
    if len(votes) != 1:
        return candidates
    layout = votes.pop()
    return [
        replace(t, layout=layout) if t.layout in EXPERT_LAYOUTS and not t.tensor.name.endswith("_blocks") else t
        for t in candidates
    ]


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def select_targets(
    ckpt: Checkpoint,
    target_modules: str | Iterable[str] | None = None,
    layers: Iterable[LayerEntry] | None = None,
    include_mtp: bool = False,
) -> tuple[list[TargetModule], str]:
    """Target modules in a deterministic order (layer, then name with numbers in numeric order), and a note on
    how they were chosen.

    Defaults come from config.json's model_type (:data:`FAMILY_TARGETS`); multimodal wrappers contribute only
    their language model's modules. Routers/gates are never default targets. DeepSeek's multi-token-prediction
    layer is left out unless ``include_mtp``. ``target_modules``: names, suffixes, regexes or module types (one
    string is one); ``layers``: see :func:`select_layers` (None: every layer).
    """
    target_modules = name_list(target_modules) if target_modules else None
    check_target_patterns(target_modules)
    refuse_adapter(ckpt)
    own_type = str(ckpt.config.get("model_type", "")) or None
    model_type = model_family(ckpt.config)
    weights = _matrix_weights(ckpt)
    candidates = [m for w in weights for m in _modules_of(w, model_type)]
    shapes = expected_shapes(ckpt.config, model_type)
    if model_type in LAYOUT_BY_SHAPE_FAMILIES:
        candidates = _stack_layout_by_shape(candidates, shapes)
    if target_modules:
        note = f"--target-modules {','.join(target_modules)}"
        chosen = [t for t in candidates if target_matches(t, target_modules)]
    elif model_type in FAMILY_TARGETS:
        wanted = set(FAMILY_TARGETS[model_type])
        note = f"defaults for model_type '{own_type}'" + (
            f" (its language model's, '{model_type}')" if model_type != own_type else ""
        )
        chosen = [t for t in candidates if t.module_type in wanted and t.layer is not None]
        if any(_in_other_tower(t.name) for t in chosen) or (
            isinstance(ckpt.config.get("text_config"), dict)
            and any(p in t.name for t in chosen for p in _LANGUAGE_MODEL)
        ):
            chosen = [t for t in chosen if not _in_other_tower(t.name)]
            language = [t for t in chosen if any(p in t.name for p in _LANGUAGE_MODEL)]
            chosen = language or chosen
            note += " (language model only)"
    else:
        why = (
            f"unknown model_type '{model_type}'"
            if model_type
            else "no model_type in config.json"
            if ckpt.config
            else "no config.json beside the weights"
        )
        chosen = [
            t
            for t in candidates
            if t.layout not in EXPERT_LAYOUTS and not _NEVER_BY_DEFAULT.search(t.name) and not ROUTER.search(t.name)
        ]
        # outside the numbered layers sit heads and projectors (DistilBERT's vocab_transform): not a layer's module
        in_layers = any(t.layer is not None for t in chosen)
        chosen = [t for t in chosen if t.layer is not None] if in_layers else chosen
        where = " in the numbered layers" if in_layers else ""
        stacks = sorted({t.logical_name.removesuffix(".weight") for t in candidates if t.layout in EXPERT_LAYOUTS})
        left = f"; {len(stacks)} 3-D expert stacks left out (e.g. {stacks[0]})" if stacks else ""
        note = (
            f"{why}: every 2-D weight{where} except embeddings, norms, heads and routers{left} "
            "(no shape checks against config.json; choose modules with --target-modules)"
        )
    mtp = mtp_layers(ckpt.config)
    if mtp and not include_mtp:
        chosen = [t for t in chosen if t.layer not in mtp]
        skipped = ", ".join(map(str, sorted(mtp)))
        note += f"; multi-token-prediction layer {skipped} skipped (scan it with --include-mtp, or include_mtp=True)"
    entries = layer_list(layers) if layers is not None else None  # (a tuple: read twice below)
    if entries is not None:
        chosen = select_layers(chosen, entries, (t.name for t in candidates))
    if not chosen:
        sample = sorted({t.module_type for t in candidates})[:30]
        raise ConfigError(
            f"no target modules matched ({note}"
            + (f", layers [{format_layers(entries)}]" if entries is not None else "")
            + f"); weights in this checkpoint have types: {', '.join(sample) or 'none'}"
            + (f"; its layers: {layers_there(t.name for t in candidates)}" if entries is not None else "")
            + _weight_suffix_hint(target_modules or [])
            + _tied_head_hint(ckpt, target_modules)
        )
    chosen.sort(key=lambda t: (t.layer if t.layer is not None else 1 << 30, _natural_key(t.name)))
    experts = expected_experts(ckpt.config, model_type)
    for t in chosen:
        check_shape_against_config(t, shapes, experts)
    check_weight_ranks(ckpt, chosen, FAMILY_TARGETS.get(model_type or "", ()) if not target_modules else (), entries)
    check_moe_layers(ckpt.config, model_type, candidates, chosen)
    if not ckpt.one_shard:  # one shard given alone holds some layers, and says so
        check_layer_count(ckpt.config, candidates, chosen)
    check_expert_counts(candidates, chosen, experts, EXPERT_COUNT_KEYS.get(model_type or ""))
    return chosen, note


def unmatched_target_patterns(
    ckpt: Checkpoint, target_modules: str | Iterable[str] | None, chosen: Sequence[TargetModule], layers_given: bool
) -> str:
    """A note naming the ``--target-modules`` entries that select none of the ``chosen`` modules while the others
    select some ("" when each selects one): a mistyped name (``v_porj``) was dropped without a word, and the bundle
    then lacked the modules the user meant to train."""
    patterns = name_list(target_modules) if target_modules else []
    unmatched = [p for p in dict.fromkeys(patterns) if not any(target_matches(t, p) for t in chosen)]
    if not unmatched:
        return ""
    where = "of the selected layers" if layers_given else "of this checkpoint"
    types = sorted({m.module_type for w in _matrix_weights(ckpt) for m in _modules_of(w, None)})
    shown = ", ".join(types[:30]) + (", ..." if len(types) > 30 else "")
    tied = _tied_head_hint(ckpt, unmatched)
    return (
        f"--target-modules {', '.join(repr(p) for p in unmatched)} matched no module {where}"
        + ("" if tied else " (a typo?)")
        + f"; scanning the {len(chosen)} modules the other names matched; module types here: {shown}"
        + _weight_suffix_hint(unmatched)
        + tied
    )


# --------------------------------------------------------------------------- shape checks
def check_weight_ranks(
    ckpt: Checkpoint, chosen: Sequence[TargetModule], default_types: Iterable[str], layers: Iterable[object] | None
) -> None:
    """A layer weight of a chosen module type (or of a family default type) that is not 2-D (nor a 3-D expert stack)
    is refused, naming it: selection takes 2-D ``*.weight`` tensors only, so a q_proj stored flattened or folded (a
    damaged or mis-converted file) would silently drop out. Checked in the selected layers ('decoder:3' checks every
    stack's layer 3: a refusal check may be wide)."""
    types = {t.module_type for t in chosen} | set(default_types)
    indices = {i for _, i in map(layer_entry, layers)} if layers is not None else None
    indices = None if indices is not None and None in indices else indices  # a whole stack: every layer
    for name, weight in ckpt.logical_weights().items():
        module = name.removesuffix(".weight")
        layer = layer_of(module)
        if module == name or layer is None or (indices is not None and layer not in indices):
            continue
        mtype = module_type_of(module)
        if mtype not in types or len(weight.shape) == 2 or (len(weight.shape) == 3 and _STACKED.search(name)):
            continue
        raise CheckpointError(
            f"{weight.file.name}: tensor '{name}' has shape {list(weight.shape)}, but a {mtype} weight is a 2-D "
            "d_out x d_in matrix; the file is damaged or was converted with another layout: re-download or "
            "re-convert the checkpoint"
        )


def _ints(c: dict[str, Any], *keys: str) -> list[int]:
    return [int(c[k]) for k in keys]


def _glu(prefix: str, inter: int, hidden: int, names: tuple[str, str, str] = _GLU) -> dict[str, tuple[int, int]]:
    gate, up, down = names
    return {f"{prefix}.{gate}": (inter, hidden), f"{prefix}.{up}": (inter, hidden), f"{prefix}.{down}": (hidden, inter)}


def _fused(prefix: str, inter: int, hidden: int) -> dict[str, tuple[int, int]]:
    return {f"{prefix}.gate_up_proj": (2 * inter, hidden), f"{prefix}.down_proj": (hidden, inter)}


def _attention(c: dict[str, Any]) -> dict[str, tuple[int, int]]:
    h, heads = _ints(c, "hidden_size", "num_attention_heads")
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    return {
        "self_attn.q_proj": (heads * hd, h),
        "self_attn.k_proj": (kv * hd, h),
        "self_attn.v_proj": (kv * hd, h),
        "self_attn.o_proj": (h, heads * hd),
    }


def _mla(c: dict[str, Any]) -> dict[str, tuple[int, int] | None]:
    """DeepSeek's multi-head latent attention (q_lora_rank None: a plain q_proj)."""
    h, heads, kv_rank, nope, rope, v = _ints(
        c, "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"
    )
    qk = nope + rope
    shapes: dict[str, tuple[int, int] | None] = {
        "self_attn.kv_a_proj_with_mqa": (kv_rank + rope, h),
        "self_attn.kv_b_proj": (heads * (nope + v), kv_rank),
        "self_attn.o_proj": (h, heads * v),
        "eh_proj": (h, 2 * h),
    }
    if c.get("q_lora_rank") is None:
        shapes.update({"self_attn.q_proj": (heads * qk, h), "self_attn.q_a_proj": None, "self_attn.q_b_proj": None})
    else:
        q_rank = int(c["q_lora_rank"])
        shapes.update({"self_attn.q_a_proj": (q_rank, h), "self_attn.q_b_proj": (heads * qk, q_rank)})
        shapes["self_attn.q_proj"] = None
    return shapes


#: The Qwen mixture-of-experts families (one config layout: moe_intermediate_size, mlp_only_layers, ...).
_QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_next")
#: Families whose routed experts are Mixtral's (block_sparse_moe.experts.<e>.w1/w2/w3 of intermediate_size).
_MIXTRAL_TYPES = ("mixtral", "phimoe", "minimax", "minimax_m2")


def _width(c: dict[str, Any], key: str) -> int | None:
    """A feed-forward width from config.json: an int, or a per-layer list whose entries agree (Gemma-3n); None when
    they differ (a module type then has no single shape to check)."""
    value = c[key]
    if isinstance(value, list):
        return int(value[0]) if value and len(set(value)) == 1 else None
    return int(value)


def _other_shapes(c: dict[str, Any], model_type: str | None) -> dict[str, tuple[int, int] | None] | None:
    """Shapes of the families whose layers are neither Llama's attention nor a GLU (Phi-2, StarCoder2, GPT-NeoX,
    Falcon), or that add their own modules to it (Qwen3-Next's gated attention and Gated DeltaNet, MiniMax's
    lightning attention, Granite's MoE and Mamba-2 layers, GLM's fused gate_up_proj, DeepSeek-style shared
    experts); None for the others."""
    h = int(c["hidden_size"])
    if model_type in ("gpt_neox", "falcon"):
        heads = int(c["num_attention_heads"])
        hd = h // heads
        qkv = 3 * h
        if model_type == "falcon" and c.get("new_decoder_architecture"):
            qkv = (heads + 2 * int(c.get("num_kv_heads") or heads)) * hd
        elif model_type == "falcon" and c.get("multi_query", True):
            qkv = h + 2 * hd
        i = int(c.get("ffn_hidden_size") or 4 * h) if model_type == "falcon" else int(c["intermediate_size"])
        attn = "attention" if model_type == "gpt_neox" else "self_attention"
        return {
            f"{attn}.query_key_value": (qkv, h),
            f"{attn}.dense": (h, h),
            "mlp.dense_h_to_4h": (i, h),
            "mlp.dense_4h_to_h": (h, i),
        }
    attention: dict[str, tuple[int, int] | None] = {**_attention(c)}
    if model_type in ("phi", "starcoder2"):
        i = int(c["intermediate_size"])
        up, down = ("mlp.fc1", "mlp.fc2") if model_type == "phi" else ("mlp.c_fc", "mlp.c_proj")
        attention["self_attn.dense"] = attention["self_attn.o_proj"]
        return {**attention, up: (i, h), down: (h, i)}
    if model_type in _GLM_TYPES:
        return {**attention, **_fused("mlp", int(c["intermediate_size"]), h)}
    if model_type in _SHARED_EXPERTS_MOE_TYPES:
        moe = int(c["moe_intermediate_size"])
        n_shared = c.get("moe_num_shared_experts" if model_type == "ernie4_5_moe" else "n_shared_experts") or 0
        shared = _glu("mlp.shared_experts", moe * int(n_shared), h)
        return {
            **attention,
            **_glu("mlp", int(c["intermediate_size"]), h),
            **_glu("mlp.experts", moe, h),
            **_fused("mlp.experts", moe, h),
            **(shared if n_shared else dict.fromkeys(shared)),
        }
    if model_type in _GRANITE_MOE_TYPES:
        i = int(c["intermediate_size"])
        shapes = {**attention, "block_sparse_moe.input_linear": (2 * i, h), "block_sparse_moe.output_linear": (h, i)}
        width = int(c.get("shared_intermediate_size") or 0)
        if width:
            shapes.update({"shared_mlp.input_linear": (2 * width, h), "shared_mlp.output_linear": (h, width)})
        if c.get("mamba_expand") is not None:  # Mamba-2: in_proj gives x and z, B and C per group, dt per head
            inner = int(c["mamba_expand"] * h)
            groups = 2 * int(c["mamba_n_groups"]) * int(c["mamba_d_state"])
            shapes["mamba.in_proj"] = (2 * inner + groups + int(c["mamba_n_heads"]), h)
            shapes["mamba.out_proj"] = (h, inner)
        return shapes
    if model_type in ("olmoe", "hunyuan_v1_moe"):  # experts (and Hunyuan's shared MLP) of intermediate_size
        i = int(c["intermediate_size"])
        shared = _glu("mlp.shared_mlp", i, h) if model_type == "hunyuan_v1_moe" else {}
        return {**attention, **_glu("mlp.experts", i, h), **_fused("mlp.experts", i, h), **shared}
    return None


def _attention_extras(c: dict[str, Any], model_type: str | None, attention: dict[str, tuple[int, int]]) -> None:
    """Qwen3-Next's gated q_proj (query and gate) and Gated DeltaNet layers; MiniMax's lightning attention."""
    h = int(c["hidden_size"])
    if model_type == "qwen3_next":
        q_out, _ = attention["self_attn.q_proj"]
        keys = int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
        values = int(c["linear_num_value_heads"]) * int(c["linear_value_head_dim"])
        attention.update(
            {
                "self_attn.q_proj": (2 * q_out, h),
                "linear_attn.in_proj_qkvz": (2 * keys + 2 * values, h),
                "linear_attn.in_proj_ba": (2 * int(c["linear_num_value_heads"]), h),
                "linear_attn.out_proj": (h, values),
            }
        )
    elif model_type == "minimax":
        inner = attention["self_attn.o_proj"][1]
        attention.update(
            {
                "self_attn.qkv_proj": (3 * inner, h),
                "self_attn.out_proj": (h, inner),
                "self_attn.output_gate": (inner, h),
            }
        )


def _family_shapes(c: dict[str, Any], model_type: str | None) -> dict[str, tuple[int, int] | None]:
    if model_type == "gpt2":
        e = int(c["n_embd"])
        inner = int(c.get("n_inner") or 4 * e)
        return {"attn.c_attn": (3 * e, e), "attn.c_proj": (e, e), "mlp.c_fc": (inner, e), "mlp.c_proj": (e, inner)}
    if model_type in _BERT_TYPES or model_type == "deberta-v2":
        h, i, heads = _ints(c, "hidden_size", "intermediate_size", "num_attention_heads")
        inner = heads * int(c.get("attention_head_size") or h // heads) if model_type == "deberta-v2" else h
        to_heads = FAMILY_TARGETS[model_type][:-3]  # the projections of h to the heads, then the output's three
        return {
            **{a: (inner, h) for a in to_heads},
            "attention.output.dense": (h, inner),
            "intermediate.dense": (i, h),
            "output.dense": (h, i),
        }
    if model_type == "distilbert":
        h, i = _ints(c, "dim", "hidden_dim")
        return {
            **{f"attention.{p}": (h, h) for p in ("q_lin", "k_lin", "v_lin", "out_lin")},
            "ffn.lin1": (i, h),
            "ffn.lin2": (h, i),
        }
    if model_type == "modernbert":
        h, i = _ints(c, "hidden_size", "intermediate_size")
        return {"attn.Wqkv": (3 * h, h), "attn.Wo": (h, h), "mlp.Wi": (2 * i, h), "mlp.Wo": (h, i)}
    if model_type in _BART_TYPES:
        d = int(c["d_model"])
        bart: dict[str, tuple[int, int] | None] = {m: (d, d) for m in _BART[:-2]}
        ffn_dims = {int(c[k]) for k in ("encoder_ffn_dim", "decoder_ffn_dim")}
        if len(ffn_dims) == 1:  # fc1/fc2 of encoder and decoder layers share a module type: checked when dims agree
            (f,) = ffn_dims
            bart.update({"fc1": (f, d), "fc2": (d, f)})
        return bart
    if model_type in _T5_TYPES:
        d, inner, ff = int(c["d_model"]), int(c["num_heads"]) * int(c["d_kv"]), int(c["d_ff"])
        attention = {f"layer.{i}.{a}.{p}": (inner, d) for i, a in ((0, "SelfAttention"), (1, "EncDecAttention"))
                     for p in "qkv"}  # fmt: skip
        attention.update({"layer.0.SelfAttention.o": (d, inner), "layer.1.EncDecAttention.o": (d, inner)})
        ffn = {f"layer.{i}.DenseReluDense.{p}": (ff, d) for i in (1, 2) for p in ("wi", "wi_0", "wi_1")}
        return {**attention, **ffn, "layer.1.DenseReluDense.wo": (d, ff), "layer.2.DenseReluDense.wo": (d, ff)}
    h = int(c["hidden_size"])
    if model_type in ("deepseek_v2", "deepseek_v3"):
        moe = int(c["moe_intermediate_size"])
        shared = moe * int(c.get("n_shared_experts") or 1)
        return {
            **_mla(c),
            **_glu("mlp", int(c["intermediate_size"]), h),
            **_glu("mlp.experts", moe, h),
            **_fused("mlp.experts", moe, h),
            **_glu("mlp.shared_experts", shared, h),
        }
    other = _other_shapes(c, model_type)
    if other is not None:
        return other
    attention = _attention(c)
    _attention_extras(c, model_type, attention)
    if model_type == "phi3":
        heads, kv = attention["self_attn.q_proj"][0], attention["self_attn.k_proj"][0]
        fused = {"self_attn.qkv_proj": (heads + 2 * kv, h), "self_attn.o_proj": attention["self_attn.o_proj"]}
        return {**fused, **_fused("mlp", int(c["intermediate_size"]), h)}
    shapes: dict[str, tuple[int, int] | None] = {**attention}
    if model_type in _MIXTRAL_TYPES:
        i = int(c["intermediate_size"])
        return {
            **shapes,
            **_glu("block_sparse_moe.experts", i, h, ("w1", "w3", "w2")),
            **_fused("mlp.experts", i, h),
        }
    if model_type in _QWEN_MOE_TYPES:
        moe = int(c["moe_intermediate_size"])
        shapes.update({**_glu("mlp", int(c["intermediate_size"]), h), **_glu("mlp.experts", moe, h)})
        shapes.update(_fused("mlp.experts", moe, h))
        if c.get("shared_expert_intermediate_size"):
            shapes.update(_glu("mlp.shared_expert", int(c["shared_expert_intermediate_size"]), h))
        return shapes
    if model_type in ("llama4", "llama4_text"):
        i = int(c["intermediate_size"])
        dense = int(c.get("intermediate_size_mlp") or i)
        return {
            **shapes,
            **_glu("feed_forward", dense, h),
            **_glu("feed_forward.shared_expert", i, h),
            **_fused("feed_forward.experts", i, h),
        }
    if model_type == "gpt_oss":
        return {**shapes, **_fused("mlp.experts", int(c["intermediate_size"]), h)}
    inter = _width(c, "intermediate_size")
    return {**shapes, **(_glu("mlp", inter, h) if inter is not None else {})}


def expected_shapes(config: dict[str, Any], model_type: str | None) -> dict[str, tuple[int, int] | None]:
    """[d_out, d_in] implied by config.json (``text_config`` for multimodal wrappers) for each default module
    type of a known family (None: config.json says the module does not exist, e.g. q_a_proj without
    q_lora_rank); empty when the family is unknown or config.json lacks a dimension."""
    if model_type not in FAMILY_TARGETS:
        return {}
    try:
        return _family_shapes(text_config(config), model_type)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return {}


#: config.json key holding the number of routed experts, by family.
EXPERT_COUNT_KEYS = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
    "qwen3_vl_moe": "num_experts",
    "qwen3_vl_moe_text": "num_experts",
    "deepseek_v2": "n_routed_experts",
    "deepseek_v3": "n_routed_experts",
    "llama4": "num_local_experts",
    "llama4_text": "num_local_experts",
    "gpt_oss": "num_local_experts",
    **{t: "num_local_experts" for t in (*_MIXTRAL_TYPES, *_GRANITE_MOE_TYPES)},
    **{t: "n_routed_experts" for t in ("glm4_moe", "glm4v_moe", "glm4v_moe_text", "dots1")},
    "ernie4_5_moe": "moe_num_experts",
    **{t: "num_experts" for t in ("olmoe", "hunyuan_v1_moe", "qwen3_next")},
}


def expected_experts(config: dict[str, Any], model_type: str | None) -> int | None:
    """Number of routed experts per MoE layer from config.json, or None."""
    key = EXPERT_COUNT_KEYS.get(model_type or "")
    value = text_config(config).get(key) if key else None
    return int(value) if isinstance(value, int) else None


def check_shape_against_config(
    t: TargetModule, shapes: dict[str, tuple[int, int] | None], n_experts: int | None = None
) -> None:
    """Refuse a weight whose shape (or expert count) contradicts config.json (a wrong or mixed-up checkpoint)."""
    where = f"{t.tensor.file.name}: tensor '{t.tensor.name}'"
    ndim = 3 if t.layout in EXPERT_LAYOUTS else 2
    if len(t.logical_shape) != ndim:
        raise CheckpointError(f"{where} is not {ndim}-D: shape {list(t.logical_shape)}")
    if ndim == 3 and n_experts is not None and t.logical_shape[0] != n_experts:
        raise CheckpointError(
            f"{where} stacks {t.logical_shape[0]} experts but config.json says {n_experts}; "
            "the weights and config.json do not match"
        )
    if t.module_type in shapes and shapes[t.module_type] is None:
        raise CheckpointError(
            f"{where} is a {t.module_type} weight, which config.json says this model does not have "
            "(e.g. q_a_proj without q_lora_rank); the weights and config.json do not match"
        )
    want = shapes.get(t.module_type)
    if want is None or tuple(t.shape) == want:
        return
    hint = " (stored transposed?)" if tuple(reversed(t.shape)) == want else ""
    raise CheckpointError(
        f"{where} has [d_out, d_in] = {list(t.shape)} for module type {t.module_type} but config.json implies "
        f"{list(want)}{hint}; the weights and config.json do not match"
    )


def check_expert_counts(
    candidates: Sequence[TargetModule], chosen: Sequence[TargetModule], n_experts: int | None, key: str | None
) -> None:
    """Per-expert tensors (Mixtral, Qwen-MoE, DeepSeek): each chosen (layer, expert module type) must hold experts
    0..n-1, n from config.json, as a 3-D stack must; a missing expert means a partial download or conversion."""
    if n_experts is None:
        return
    wanted = {(t.layer, t.module_type) for t in chosen if t.expert is not None and t.layout not in EXPERT_LAYOUTS}
    found: dict[tuple[int | None, str], set[int]] = {}
    for t in candidates:
        if (t.layer, t.module_type) in wanted and t.expert is not None:
            found.setdefault((t.layer, t.module_type), set()).add(t.expert)
    for (layer, mtype), experts in sorted(found.items(), key=lambda item: (item[0][0] or 0, item[0][1])):
        if experts != set(range(n_experts)):
            raise CheckpointError(
                f"layer {layer}: {mtype} has experts {span(experts)} but config.json says {key} = {n_experts} "
                f"(experts 0-{n_experts - 1}); the checkpoint is incomplete (a shard or index entry missing?) or "
                "the weights and config.json do not match"
            )


#: config.json fields that say which decoder layers are mixture-of-experts layers (the others dense), by family, and
#: the prefix of the layer's feed-forward modules. transformers (and DeepSeek's own modeling code) build layer i as:
#:   qwen2_moe, qwen3_moe: MoE iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
#:   deepseek_v2/v3: MoE iff n_routed_experts is not null and i >= first_k_dense_replace and i % moe_layer_freq == 0
#:   llama4: MoE iff i in moe_layers, which defaults to the i with (i + 1) % interleave_moe_layer_step == 0
#:   glm4_moe, glm4v_moe, dots1: as DeepSeek (their configs have no moe_layer_freq: 1)
#:   ernie4_5_moe: MoE iff (i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= i <= moe_layer_end_index
MOE_LAYER_FIELDS: dict[str, tuple[str, ...]] = {
    **{t: ("mlp_only_layers", "decoder_sparse_step") for t in _QWEN_MOE_TYPES},
    **{t: ("first_k_dense_replace", "moe_layer_freq") for t in ("deepseek_v2", "deepseek_v3", "dots1")},
    **{t: ("first_k_dense_replace", "moe_layer_freq") for t in ("glm4_moe", "glm4v_moe", "glm4v_moe_text")},
    "ernie4_5_moe": ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"),
    "llama4": ("moe_layers", "interleave_moe_layer_step"),
    "llama4_text": ("moe_layers", "interleave_moe_layer_step"),
}
_FFN_PREFIX = {"llama4": "feed_forward.", "llama4_text": "feed_forward."}  # the other families': "mlp."

#: Whether config.json makes a layer index a mixture-of-experts layer, and why (naming the config field).
MoeLayerRule = Callable[[int], tuple[bool, str]]


def _config_int(c: dict[str, Any], key: str, default: int, least: int) -> int:
    value = c.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise CorruptCheckpointError(
            f"config.json: {key} must be an integer >= {least}, got {value!r:.80}; restore the config.json that "
            "came with these weights"
        )
    return value


def _config_layers(c: dict[str, Any], key: str) -> list[int] | None:
    value = c.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise CorruptCheckpointError(
            f"config.json: {key} must be a list of layer indices, got {value!r:.80}; restore the config.json that "
            "came with these weights"
        )
    return sorted(set(value))


def moe_layer_rule(config: dict[str, Any], model_type: str | None) -> MoeLayerRule | None:
    """Which layers config.json makes mixture-of-experts layers (:data:`MOE_LAYER_FIELDS`), as transformers builds
    the model; None when config.json gives none of the family's fields (nothing to check against). A field of the
    wrong type is a CorruptCheckpointError."""
    keys = MOE_LAYER_FIELDS.get(model_type or "")
    c = text_config(config)
    if not keys or not any(k in c for k in keys):
        return None
    if model_type in _QWEN_MOE_TYPES:
        dense = _config_layers(c, "mlp_only_layers") or []
        step = _config_int(c, "decoder_sparse_step", 1, 1)
        no_experts = c.get("num_experts") == 0

        def qwen(i: int) -> tuple[bool, str]:
            if i in dense:
                return False, f"mlp_only_layers = {dense} lists it"
            if no_experts:
                return False, "num_experts = 0"
            if (i + 1) % step:
                return False, f"decoder_sparse_step = {step}: MoE layers are those with (index + 1) % {step} == 0"
            return True, f"mlp_only_layers = {dense} does not list it, and decoder_sparse_step = {step}"

        return qwen
    if model_type == "ernie4_5_moe":
        start = _config_int(c, "moe_layer_start_index", 0, 0)
        end = _config_int(c, "moe_layer_end_index", 1 << 30, 0)
        interval = _config_int(c, "moe_layer_interval", 1, 1)
        fields = f"moe_layer_start_index = {start}, moe_layer_end_index = {end}, moe_layer_interval = {interval}"

        def ernie(i: int) -> tuple[bool, str]:
            return (start <= i <= end and (i + 1) % interval == 0), fields

        return ernie
    if "first_k_dense_replace" in keys:
        first = _config_int(c, "first_k_dense_replace", 0, 0)
        freq = _config_int(c, "moe_layer_freq", 1, 1)
        no_experts = "n_routed_experts" in c and c["n_routed_experts"] is None

        def deepseek(i: int) -> tuple[bool, str]:
            if no_experts:
                return False, "n_routed_experts = null"
            if i < first:
                return False, f"first_k_dense_replace = {first}: layers 0-{first - 1} are dense"
            if i % freq:
                return False, f"moe_layer_freq = {freq}: MoE layers are those with index % {freq} == 0"
            return True, f"first_k_dense_replace = {first}, moe_layer_freq = {freq}"

        return deepseek
    listed = _config_layers(c, "moe_layers")
    step = _config_int(c, "interleave_moe_layer_step", 1, 1)

    def llama4(i: int) -> tuple[bool, str]:
        if listed is not None:
            return (i in listed), f"moe_layers = {listed} {'lists' if i in listed else 'does not list'} it"
        if (i + 1) % step:
            return False, f"interleave_moe_layer_step = {step}: MoE layers are those with (index + 1) % {step} == 0"
        return True, f"interleave_moe_layer_step = {step}"

    return llama4


def check_moe_layers(
    config: dict[str, Any], model_type: str | None, candidates: Sequence[TargetModule], chosen: Sequence[TargetModule]
) -> None:
    """Each layer whose feed-forward modules are chosen must be what config.json says (:func:`moe_layer_rule`): a
    dense layer holds no routed experts, a mixture-of-experts layer holds some (how many: check_expert_counts).

    A contradiction means the weights and config.json do not match (another model's config, a wrong conversion):
    transformers would build the layer otherwise, and a bundle made from them would not fit the model."""
    rule = moe_layer_rule(config, model_type)
    if rule is None:
        return
    prefix = _FFN_PREFIX.get(model_type or "", "mlp.")
    layers = sorted({t.layer for t in chosen if t.layer is not None and t.module_type.startswith(prefix)})
    members: dict[int, list[TargetModule]] = {}
    for t in candidates:
        if t.layer in layers:
            members.setdefault(t.layer, []).append(t)
    do = "the weights and config.json do not match: use the config.json that came with these weights, or correct it"
    for layer in layers:
        experts = [t for t in members[layer] if t.expert is not None and t.module_type.startswith(f"{prefix}experts")]
        dense = [t for t in members[layer] if t.module_type in {f"{prefix}{p}" for p in _GLU}]
        moe, why = rule(layer)
        if experts and not moe:
            t = experts[0]
            raise CorruptCheckpointError(
                f"layer {layer}: {t.tensor.file.name} holds routed experts there ('{t.tensor.name}'), but config.json "
                f"makes layer {layer} a dense layer ({why}); {do}"
            )
        if moe and not experts:
            found = f"a dense feed-forward ('{dense[0].tensor.name}')" if dense else "no routed experts"
            raise CorruptCheckpointError(
                f"layer {layer}: config.json makes it a mixture-of-experts layer ({why}), but the checkpoint holds "
                f"{found} there; {do}"
            )


#: words naming a multimodal model's non-text layer stacks (``model.vision_tower.encoder.layers``, ``visual.blocks``),
#: whose layer count is their own sub-config's (``vision_config``), not ``num_hidden_layers`` of the text model
_OTHER_TOWERS = ("vision", "visual", "image", "audio", "speech", "whisper")


def check_layer_count(
    config: dict[str, Any], candidates: Sequence[TargetModule], chosen: Sequence[TargetModule]
) -> None:
    """The layers of the stack the chosen modules sit in must be config.json's ``num_hidden_layers`` (``text_config``
    for multimodal wrappers), 0 to N-1, DeepSeek's multi-token-prediction layers besides: a layer missing (a shard
    left out of a directory without index, a truncated conversion) or one beyond N (another model's config.json;
    transformers would not load it) made a complete-looking bundle of another model than the one transformers builds.
    Checked only where the chosen modules sit in one stack and the model is no encoder-decoder (BART's
    num_hidden_layers is its encoder's count; a distilled decoder has fewer)."""
    c = text_config(config)
    n_layers = c.get("num_hidden_layers")
    stacks = {where[0] for where in map(stack_of, (t.name for t in chosen)) if where is not None}
    two_stacks = c.get("is_encoder_decoder") or any(k in c for k in ("encoder_layers", "decoder_layers"))
    if type(n_layers) is not int or n_layers < 0 or len(stacks) != 1 or two_stacks:
        return
    (stack,) = stacks
    if any(tower in stack.lower() for tower in _OTHER_TOWERS):  # a vision/audio tower: its count is in its own config
        return
    held = {
        where[1] for where in map(stack_of, (t.name for t in candidates)) if where is not None and where[0] == stack
    }
    missing = sorted(set(range(n_layers)) - held)
    extra = sorted(held - set(range(n_layers)) - mtp_layers(config))
    if not missing and not extra:
        return
    what = (
        f"layer{'s' if len(missing) > 1 else ''} {span(missing)} missing (a shard left out, or a partial conversion?)"
        if missing
        else f"layer{'s' if len(extra) > 1 else ''} {span(extra)} beyond them, which transformers would not load"
    )
    raise CorruptCheckpointError(
        f"config.json says num_hidden_layers {n_layers} (layers 0-{n_layers - 1}), but the checkpoint holds {stack} "
        f"layers {span(held)}: {what}; use the complete checkpoint with the config.json that came with it"
    )


def modules_by_name(ckpt: Checkpoint) -> dict[str, TargetModule]:
    """Every module a checkpoint holds (targets or not), by the name a bundle records: how verify and variant
    scans find a recorded module's weight, 3-D expert slices included."""
    model_type = model_family(ckpt.config)
    return {t.name: t for w in _matrix_weights(ckpt) for t in _modules_of(w, model_type)}
