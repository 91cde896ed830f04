"""Checks of a checkpoint's chosen target modules against its config.json: shapes implied by the family's config
dims, the number of experts, which layers hold experts, the layer count, and weights that are not matrices.

Each refuses a contradiction (the weights and config.json do not match, a partial copy) in one line naming the
tensor or layer. Re-exported by :mod:`plate_inspect.targets` (import from there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from plate_inspect.checkpoint import Checkpoint
from plate_inspect.errors import CheckpointError, CorruptCheckpointError
from plate_inspect.layer_selection import layer_entry, layer_of, module_type_of, span, stack_of
from plate_inspect.target_families import (
    _BART,
    _BART_TYPES,
    _BERT_TYPES,
    _DEEPSEEK_TYPES,
    _FFN_PREFIX,
    _GLM_TYPES,
    _GLU,
    _GRANITE_MOE_TYPES,
    _MIXTRAL_TYPES,
    _OTHER_TOWERS,
    _QWEN_MOE_TYPES,
    _SHARED_EXPERTS_MOE_TYPES,
    _STACKED,
    _T5_TYPES,
    EXPERT_COUNT_KEYS,
    EXPERT_LAYOUTS,
    FAMILY_TARGETS,
    MOE_LAYER_FIELDS,
    mtp_layers,
    text_config,
)

if TYPE_CHECKING:
    from plate_inspect.targets import TargetModule


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
            "eh_proj": (h, 2 * h),
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
    if model_type == "jamba":
        i, inner = int(c["intermediate_size"]), int(c["mamba_expand"]) * h
        rank = c.get("mamba_dt_rank")
        rank = -(-h // 16) if rank in (None, "auto") else int(rank)
        return {
            **attention,
            **_glu("feed_forward", i, h),
            **_glu("feed_forward.experts", i, h),
            **_fused("feed_forward.experts", i, h),
            "mamba.in_proj": (2 * inner, h),
            "mamba.x_proj": (rank + 2 * int(c["mamba_d_state"]), inner),
            "mamba.dt_proj": (inner, rank),
            "mamba.out_proj": (h, inner),
        }
    if model_type == "falcon_h1":  # Mamba-2's in_proj: x and z, B and C per group, dt per head
        inner = int(c.get("mamba_d_ssm") or int(c["mamba_expand"] * h))
        groups = 2 * int(c["mamba_n_groups"]) * int(c["mamba_d_state"])
        return {
            **attention,
            **_glu("feed_forward", int(c["intermediate_size"]), h),
            "mamba.in_proj": (2 * inner + groups + int(c["mamba_n_heads"]), h),
            "mamba.out_proj": (h, inner),
        }
    if model_type == "lfm2":  # the width transformers builds: 2/3 of intermediate_size, scaled, rounded up
        i = int(c["intermediate_size"])
        if c.get("block_auto_adjust_ff_dim"):
            i = int(2 * i / 3)
            if c.get("block_ffn_dim_multiplier") is not None:
                multiple = int(c["block_multiple_of"])
                i = multiple * ((int(c["block_ffn_dim_multiplier"] * i) + multiple - 1) // multiple)
        return {
            **{k: v for k, v in attention.items() if k != "self_attn.o_proj"},
            "self_attn.out_proj": attention["self_attn.o_proj"],
            "conv.in_proj": (3 * h, h),
            "conv.out_proj": (h, h),
            **_glu("feed_forward", i, h, ("w1", "w3", "w2")),
        }
    if model_type in (
        "olmoe",
        "flex_olmo",
        "hunyuan_v1_moe",
    ):  # experts (and Hunyuan's shared MLP) of intermediate_size
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
    if model_type in _DEEPSEEK_TYPES:
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
    if model_type == "jamba":
        period = _config_int(c, "expert_layer_period", 2, 1)
        offset = _config_int(c, "expert_layer_offset", 1, 0)
        single = c.get("num_experts") == 1
        rule = f"expert_layer_period = {period}, expert_layer_offset = {offset}"

        def jamba(i: int) -> tuple[bool, str]:
            return (not single and i % period == offset), ("num_experts = 1" if single else rule)

        return jamba
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
