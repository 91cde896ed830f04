"""Which weights of a checkpoint PLATE adapts: default targets per model family, matching, layouts, shape checks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from plate_inspect.checkpoint import Checkpoint, TensorInfo
from plate_inspect.errors import CheckpointError, ConfigError, UnsupportedWeightError

_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: Default target module suffixes by ``config.json`` ``model_type``.
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    **{t: _LLAMA_LIKE for t in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "olmo2")},
    "phi3": ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"),
    "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    "bert": (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ),
}
#: Families whose weights are stored as [d_in, d_out] (GPT-2's Conv1D).
CONV1D_FAMILIES = frozenset({"gpt2"})
_NEVER_BY_DEFAULT = re.compile(r"(embed|lm_head|wte|wpe|norm|ln_|layernorm|pooler|classifier|score|head)", re.I)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
_REGEX_CHARS = re.compile(r"[\\^$*+?()\[\]{}|]")


@dataclass(frozen=True)
class TargetModule:
    """One weight matrix that PLATE adapts, oriented as d_out x d_in."""

    name: str  # module name, e.g. model.layers.0.self_attn.q_proj
    tensor: TensorInfo  # the stored ``<name>.weight``
    layout: str  # "linear" ([d_out, d_in] stored) | "conv1d" ([d_in, d_out] stored)
    layer: int | None
    module_type: str  # name after the layer index, e.g. self_attn.q_proj

    @property
    def shape(self) -> tuple[int, int]:
        """[d_out, d_in], whatever the stored layout."""
        a, b = self.tensor.shape
        return (b, a) if self.layout == "conv1d" else (a, b)


def load_target(ckpt: Checkpoint, target: TargetModule) -> tuple[torch.Tensor, str]:
    """The target's weight oriented d_out x d_in (a view, stored or dequantized dtype) and its fingerprint."""
    stored, fingerprint = ckpt.read_weight(target.tensor.name)
    return (stored.T if target.layout == "conv1d" else stored), fingerprint


def parse_layers(spec: str | None) -> list[int] | None:
    """'0-3,7' -> [0, 1, 2, 3, 7]; None -> None (all layers)."""
    if spec is None or spec.strip() == "":
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ConfigError(f"--layers: cannot parse '{part}'; use e.g. '0-3,7'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ConfigError(f"--layers: empty range '{part}'")
        out.update(range(lo, hi + 1))
    return sorted(out)


def module_type_of(name: str) -> str:
    """The part of a module name after its layer index ('model.layers.3.mlp.up_proj' -> 'mlp.up_proj')."""
    m = _LAYER_INDEX.search(name + ".")
    return name[m.end() :] if m else name


def layer_of(name: str) -> int | None:
    m = _LAYER_INDEX.search(name + ".")
    return int(m.group(1)) if m else None


def _matches(module: str, pattern: str) -> bool:
    if _REGEX_CHARS.search(pattern):
        return re.fullmatch(pattern, module) is not None or re.search(pattern, module) is not None
    return module == pattern or module.endswith("." + pattern)


def select_targets(
    ckpt: Checkpoint,
    target_modules: list[str] | None = None,
    layers: list[int] | None = None,
) -> tuple[list[TargetModule], str]:
    """Target modules in a deterministic order (layer, then name), and a note on how they were chosen."""
    model_type = str(ckpt.config.get("model_type", "")) or None
    packed = sorted(n for n in ckpt.tensors if n.endswith((".qweight", ".qzeros", ".g_idx")))
    if packed:
        raise UnsupportedWeightError(
            f"tensor '{packed[0]}' is a packed quantized weight (GPTQ/AWQ), which is not supported: "
            "scan the unquantized base model instead"
        )
    candidates = {
        n[: -len(".weight")]: info for n, info in ckpt.tensors.items() if n.endswith(".weight") and len(info.shape) == 2
    }
    if target_modules:
        note = f"--target-modules {','.join(target_modules)}"
        chosen = {m: i for m, i in candidates.items() if any(_matches(m, p) for p in target_modules)}
    elif model_type in FAMILY_TARGETS:
        patterns, note = FAMILY_TARGETS[model_type], f"defaults for model_type '{model_type}'"
        chosen = {
            m: i
            for m, i in candidates.items()
            if any(_matches(m, p) for p in patterns) and not _NEVER_BY_DEFAULT.search(m)
        }
    else:
        why = f"unknown model_type '{model_type}'" if model_type else "no model_type in config.json"
        note = f"{why}: every 2-D weight except embeddings, norms and heads"
        chosen = {m: i for m, i in candidates.items() if not _NEVER_BY_DEFAULT.search(m)}
    if layers is not None:
        wanted = set(layers)
        chosen = {m: i for m, i in chosen.items() if layer_of(m) in wanted}
    if not chosen:
        sample = sorted({module_type_of(m) for m in candidates})[:30]
        raise ConfigError(
            f"no target modules matched ({note}"
            + (f", layers {layers}" if layers is not None else "")
            + f"); 2-D weights in this checkpoint have types: {', '.join(sample) or 'none'}"
        )
    layout = "conv1d" if model_type in CONV1D_FAMILIES else "linear"
    out = [TargetModule(m, info, layout, layer_of(m), module_type_of(m)) for m, info in chosen.items()]
    out.sort(key=lambda t: (t.layer if t.layer is not None else 1 << 30, t.name))
    for t in out:
        check_shape_against_config(t, ckpt.config, model_type)
    return out, note


def expected_shapes(config: dict[str, Any], model_type: str | None) -> dict[str, tuple[int, int]]:
    """[d_out, d_in] implied by config.json for each default module suffix of a known family."""
    c = config
    try:
        if model_type in ("gpt2",):
            e = int(c["n_embd"])
            inner = int(c.get("n_inner") or 4 * e)
            return {"attn.c_attn": (3 * e, e), "attn.c_proj": (e, e), "mlp.c_fc": (inner, e), "mlp.c_proj": (e, inner)}
        if model_type == "bert":
            h, i = int(c["hidden_size"]), int(c["intermediate_size"])
            return {
                "attention.self.query": (h, h),
                "attention.self.key": (h, h),
                "attention.self.value": (h, h),
                "attention.output.dense": (h, h),
                "intermediate.dense": (i, h),
                "output.dense": (h, i),
            }
        if model_type in FAMILY_TARGETS:
            h, i = int(c["hidden_size"]), int(c["intermediate_size"])
            heads = int(c["num_attention_heads"])
            kv = int(c.get("num_key_value_heads") or heads)
            hd = int(c.get("head_dim") or h // heads)
            shapes = {
                "q_proj": (heads * hd, h),
                "k_proj": (kv * hd, h),
                "v_proj": (kv * hd, h),
                "o_proj": (h, heads * hd),
                "gate_proj": (i, h),
                "up_proj": (i, h),
                "down_proj": (h, i),
            }
            if model_type == "phi3":
                shapes.update({"qkv_proj": ((heads + 2 * kv) * hd, h), "gate_up_proj": (2 * i, h)})
            return shapes
    except (KeyError, TypeError, ValueError):
        return {}
    return {}


def check_shape_against_config(t: TargetModule, config: dict[str, Any], model_type: str | None) -> None:
    """Refuse a weight whose shape contradicts config.json (a wrong or mixed-up checkpoint)."""
    if len(t.tensor.shape) != 2:
        raise CheckpointError(f"tensor '{t.tensor.name}' is not 2-D: shape {list(t.tensor.shape)}")
    shapes = expected_shapes(config, model_type)
    for suffix in sorted(shapes, key=len, reverse=True):
        if t.name.endswith("." + suffix):
            if tuple(t.shape) != shapes[suffix]:
                raise CheckpointError(
                    f"{t.tensor.file.name}: tensor '{t.tensor.name}' has [d_out, d_in] = {list(t.shape)} but "
                    f"config.json implies {list(shapes[suffix])}; the weights and config.json do not match"
                )
            return
