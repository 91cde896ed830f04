"""Which weights of a checkpoint PLATE adapts: default targets per model family, matching, layouts, shape checks.

A target is one d_out x d_in matrix. Most are a 2-D ``<module>.weight`` tensor. Mixture-of-experts checkpoints
that store all experts of a projection as one 3-D tensor (Llama-4, gpt-oss, transformers-5 fused layouts) give
one target per expert, named ``<tensor>.<e>`` (e.g. ``model.layers.3.feed_forward.experts.gate_up_proj.17``);
checkpoints with one tensor per expert (Mixtral, Qwen-MoE, DeepSeek) keep their own names. Routers and gates
are never default targets; name them with ``target_modules`` to scan them.

The module selects; the family tables live in :mod:`plate_inspect.target_families`, the checks against config.json
in :mod:`plate_inspect.target_checks`, layer selections and the layer, stack and expert parts of module names in
:mod:`plate_inspect.layer_selection`: all re-exported here (import them from here).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from plate_inspect.checkpoint import Checkpoint, TensorInfo, refuse_adapter
from plate_inspect.errors import ConfigError
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
    split_expert,
    stack_of,
)
from plate_inspect.target_checks import (
    MoeLayerRule,
    check_expert_counts,
    check_layer_count,
    check_moe_layers,
    check_shape_against_config,
    check_weight_ranks,
    expected_experts,
    expected_shapes,
    moe_layer_rule,
)
from plate_inspect.target_families import (
    _LANGUAGE_MODEL,
    _OTHER_TOWERS,
    _STACKED,
    CONV1D_FAMILIES,
    EXPERT_COUNT_KEYS,
    EXPERT_LAYOUTS,
    EXPERTS_IN_MAJOR_FAMILIES,
    FAMILY_TARGETS,
    LAYOUT_BY_SHAPE_FAMILIES,
    LAYOUTS,
    MOE_LAYER_FIELDS,
    ROUTER,
    model_family,
    mtp_layers,
    text_config,
)

#: The module's own names, and those it re-exports (family tables, config checks, layer selections).
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

_NEVER_BY_DEFAULT = re.compile(r"(embed|lm_head|wte|wpe|norm|ln_|layernorm|pooler|classifier|score|head)", re.I)
_REGEX_CHARS = re.compile(r"[\\^$*+?()\[\]{}|]")
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


def modules_by_name(ckpt: Checkpoint) -> dict[str, TargetModule]:
    """Every module a checkpoint holds (targets or not), by the name a bundle records: how verify and variant
    scans find a recorded module's weight, 3-D expert slices included."""
    model_type = model_family(ckpt.config)
    return {t.name: t for w in _matrix_weights(ckpt) for t in _modules_of(w, model_type)}
