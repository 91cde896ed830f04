"""The PLATE layer: a frozen linear map plus rho * B A Q^T, with only A trainable.

``PlateLinear`` wraps an ``nn.Linear`` (weight [d_out, d_in]) or a GPT-2 ``Conv1D`` (weight stored [d_in, d_out]).
Forward: ``y = base(x) + rho * index_add over B of ((x Q) A^T)``: B is an int64 index buffer (never a dense
d_out x r matrix), Q a frozen [d_in, k] buffer, A a zero-initialised [r, k] parameter. ``merge()`` writes
``W[B] += rho A Q^T`` into the base weight and keeps the original rows, so ``unmerge()`` restores them bit for bit.

The math (validation, the per-call cheaper evaluation order, merge/unmerge) lives in ``core`` and is shared
with the PEFT layer. ``apply_bundle(model, bundle)`` checks the bundle against the model's weights (fingerprints,
tolerant of a cast to a narrower dtype: ``weightcheck``), wraps every bundle module (optionally with a smaller k
per module from a plate-plan), freezes everything else and returns the trainable A's. ``save_adapter`` /
``load_adapter`` store the A's as safetensors with the bundle's identity, and refuse an adapter made for another
bundle or other weights.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks

from plate_inspect.arguments import bool_argument
from plate_inspect.atomic import path_argument
from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError, ConfigError, refuse_to_replace
from plate_inspect.train.core import (
    add_branch,
    check_rho,
    geometry_digest,
    merge_rows,
    unmerge_rows,
    validate_geometry,
)
from plate_inspect.train.experts import (
    ExpertBranch,
    PlateExperts,
    check_expert_against_record,
    expert_branches,
    plate_experts,
    resolve_expert_slots,
    transformers_conversions,
)
from plate_inspect.train.weightcheck import WeightSketch, check_weight

if TYPE_CHECKING:
    from plate_inspect.train.weightcheck import WeightRecord  # the weight check's record protocol

ADAPTER_FORMAT = "plate-adapter"
ADAPTER_VERSION = 1
PLAN_FORMAT = "plate-plan"


def model_argument(model: object, function: str) -> nn.Module:
    """``model`` when it is a torch module; else a ConfigError naming the argument (not an AttributeError from
    deep inside: ``'NoneType' object has no attribute 'named_modules'``)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{function}: model must be a torch.nn.Module, got {model!r:.80}")
    return model


def q_dtype_argument(q_dtype: object) -> torch.dtype | None:
    """``q_dtype`` when it is None or a torch floating dtype; else a ConfigError naming it (a string reached
    ``Tensor.to`` as a device name: 'Invalid device string'; an integer dtype was blamed on the bundle)."""
    if q_dtype is not None and not (isinstance(q_dtype, torch.dtype) and q_dtype.is_floating_point):
        raise ConfigError(f"q_dtype must be a torch floating dtype (e.g. torch.bfloat16) or None, got {q_dtype!r:.80}")
    return q_dtype


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' GPT-2 ``Conv1D`` (imported lazily: transformers is optional)."""
    if type(module).__name__ != "Conv1D":
        return False
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers not installed
        return False
    return isinstance(module, Conv1D)


def layout_of(module: nn.Module) -> str:
    """``linear`` or ``conv1d``; anything else is refused."""
    if isinstance(module, nn.Linear):
        return "linear"
    if is_conv1d(module):
        return "conv1d"
    raise ConfigError(f"PLATE wraps nn.Linear or transformers Conv1D layers, not {type(module).__name__}")


def oriented_shape(module: nn.Module) -> tuple[int, int]:
    """[d_out, d_in] of a Linear or Conv1D, whatever the stored layout."""
    layout = layout_of(module)
    a, b = layer_weight(module).shape
    return (b, a) if layout == "conv1d" else (a, b)


def layer_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a Linear / Conv1D (the base layer of a PLATE layer), typed as the tensor it is: nn.Module's
    attribute typing says ``Tensor | Module``. A DTensor or meta tensor is a tensor too."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__}.weight is not a tensor"
    return weight


def input_width_error(layer: str, x: torch.Tensor, d_in: int, d_out: int) -> RuntimeError:
    """The error of a PLATE layer given an input whose last dimension is not its d_in, naming the layer and both
    widths (torch's own "mat1 and mat2 shapes cannot be multiplied (8x5 and 4x3)" names neither); a RuntimeError,
    as nn.Linear's is, so code that catches that one catches this."""
    return RuntimeError(
        f"{layer}: the input's last dimension is {x.shape[-1]} (input shape {list(x.shape)}), but this layer maps "
        f"{d_in} input features to {d_out}; feed it tensors of shape [..., {d_in}]"
    )


_Method = TypeVar("_Method", bound=Callable[..., Any])


def compile_disabled(method: _Method) -> _Method:
    """``torch.compiler.disable(method)`` without importing torch._dynamo when the module is (that import costs ~2 s
    on every ``import plate_inspect.train.layer``): a call with torch._dynamo not loaded cannot be under
    torch.compile and runs the method directly; otherwise the disabled method (made once) runs. The flag
    ``_torchdynamo_disable`` tells a tracing torch.compile to call this wrapper eagerly rather than inline it."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(method))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return cast("_Method", call)


def output_may_be_held(module: nn.Module) -> bool:
    """True when a forward hook may hold the module's output: one of its own, or a global one
    (``torch.nn.modules.module.register_module_forward_hook``, called for every module); a PLATE layer then adds its
    branch into a new tensor rather than in place into the base output."""
    return bool(module._forward_hooks) or bool(_global_forward_hooks)


class PlateLinear(nn.Module):
    """A frozen Linear/Conv1D plus a PLATE branch: y = base(x) + rho * scatter_B((x Q) A^T) (math in ``core``)."""

    plate_B_idx: torch.Tensor  # buffers (nn.Module's attribute typing says Tensor | Module)
    plate_Q: torch.Tensor
    # what apply_bundle records on each layer it makes (save_adapter writes it; a layer made by hand has none)
    bundle_name: str
    bundle_record_fingerprint: str
    bundle_identity: dict[str, Any]
    q_dtype: str | None  # None: Q as the bundle stores it
    weight_sketch: WeightSketch | None

    def __init__(
        self,
        base: nn.Module,
        b_idx: torch.Tensor,
        q: torch.Tensor,
        rho: float = 0.5,
        digest: str | None = None,
        awaiting: AwaitingWeights | None = None,
    ) -> None:
        """``digest``: the identity of B/Q when ``q`` is a rounded copy of a bundle's Q (default: digest of ``q``);
        ``awaiting``: the base weight is on the meta device, and this is what the layer owes once it is loaded."""
        super().__init__()
        self.layout = layout_of(base)
        d_out, d_in = oriented_shape(base)
        b_idx, q = validate_geometry(b_idx, q, d_out, d_in, where=type(base).__name__)
        self.base = base
        self.rho = check_rho(rho)
        self.d_out, self.d_in = d_out, d_in
        self.geometry_digest = digest or geometry_digest(b_idx, q)
        dev = layer_weight(base).device
        self.register_buffer("plate_B_idx", b_idx.to(geometry_device(dev)))
        self.register_buffer("plate_Q", q.to(geometry_device(dev)).contiguous())
        self.plate_A = nn.Parameter(torch.zeros(b_idx.numel(), q.shape[1], device=dev, dtype=torch.float32))
        self._saved_rows: torch.Tensor | None = None
        self._inplace = type(base) is nn.Linear or is_conv1d(base)
        self._awaiting: dict[str, AwaitingWeights] = {}  # {"plate_A": ...} while the weight is on the meta device
        if awaiting is not None:
            self._awaiting["plate_A"] = awaiting
        self.register_load_state_dict_pre_hook(note_loaded_a)
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def merged(self) -> bool:
        """Whether rho A Q^T is currently written into the base weight (by :meth:`merge`)."""
        return self._saved_rows is not None

    @property
    def r(self) -> int:
        """r: the number of output rows the branch adapts (B's length)."""
        return int(self.plate_B_idx.numel())

    @property
    def k(self) -> int:
        """k: the width of the input basis Q (A is r x k)."""
        return int(self.plate_Q.shape[1])

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, oriented [d_out, d_in] (a Conv1D's is transposed)."""
        return layer_weight(self.base)

    @property
    def bias(self) -> torch.Tensor | None:
        """The base layer's bias (None when it has none)."""
        bias = self.base.bias
        return bias if isinstance(bias, torch.Tensor) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) + rho * the branch on B's rows; a merged layer runs the base alone."""
        if self._awaiting:
            self.settle(zero_a=False)
        if x.shape[-1] != self.d_in:  # one int comparison (~0.15 us); torch.compile traces it away
            raise input_width_error(getattr(self, "bundle_name", type(self).__name__), x, self.d_in, self.d_out)
        y = self.base(x)
        if self.merged:
            return y
        inplace = self._inplace and not output_may_be_held(self.base)  # a hook's tensor is kept as it is
        return add_branch(y, x, self.plate_B_idx, self.plate_Q, self.plate_A, self.rho, inplace=inplace)

    @compile_disabled
    def settle(self, zero_a: bool) -> None:
        """A layer made on meta-device weights, now loaded: check them, reload B/Q beside them, see to A."""
        with torch.inference_mode(False):
            for key, awaiting in list(self._awaiting.items()):
                sketch, geometry = settle_branch(self, self.base, key, awaiting, zero_a)
                if geometry is not None:  # else B/Q came with a state dict (persistent buffers): kept as loaded
                    b_idx, q = geometry
                    dev = layer_weight(self.base).device
                    self.plate_B_idx = b_idx.to(dev)
                    self.plate_Q = q.to(dev, self.plate_Q.dtype).contiguous()
                self.weight_sketch = sketch if sketch is not None else getattr(self, "weight_sketch", None)
                del self._awaiting[key]

    def merge(self) -> None:
        """W[B] += rho A Q^T in the base weight (computed in float32, rounded once to the weight's dtype)."""
        if self._awaiting:
            self.settle(zero_a=False)
        if not self.merged:
            self._saved_rows = merge_rows(
                layer_weight(self.base), self.layout, self.plate_B_idx, self.plate_A, self.plate_Q, self.rho
            )

    def unmerge(self) -> None:
        """Restore the base weight exactly as it was before merge()."""
        if self._saved_rows is not None:  # merged
            unmerge_rows(layer_weight(self.base), self.layout, self.plate_B_idx, self._saved_rows)
            self._saved_rows = None

    def extra_repr(self) -> str:
        """d_in, d_out, r, k, rho and layout, for the model's repr."""
        return f"d_in={self.d_in}, d_out={self.d_out}, r={self.r}, k={self.k}, rho={self.rho}, layout={self.layout}"


# --------------------------------------------------------------------------- models on the meta device
def is_meta_tensor(t: torch.Tensor) -> bool:
    """True for a meta tensor, or a DTensor whose local shard is one (a sharded model not materialised yet)."""
    return t.is_meta or (hasattr(t, "to_local") and t.to_local().is_meta)


def geometry_device(weight_device: torch.device) -> torch.device:
    """Where B/Q go beside a weight: its device, or the CPU while it is on meta (real values survive the re-placing
    of non-persistent buffers that accelerate's FSDP2 loading does; ``to_empty()`` wipes them: they are reloaded)."""
    return torch.device("cpu") if weight_device.type == "meta" else weight_device


@dataclass
class AwaitingWeights:
    """What a PLATE branch made on a meta-device weight owes once the weight is loaded.

    The weight check (it needs the values), B/Q (reloaded from the bundle then: ``to_empty()`` leaves buffers
    uninitialised) and A (on the meta device, like the weight: a state dict fills it, such as the one accelerate
    broadcasts from rank 0, or ``finish_meta_init`` zeroes it).
    """

    name: str  # the model's module name, for messages
    record: WeightRecord  # what the weight must be: the bundle's ModuleRecord, or an adapter's record of it
    check_fingerprint: bool
    reference: WeightSketch | None
    bundle: Bundle | None  # B/Q are reloaded from it (None: the adapter's state dict carries them)
    bundle_module: str
    k: int | None
    digest: str
    adapter: bool = False
    a_loaded: bool = False  # a state dict has given A values since it was made on the meta device
    record_entry: dict[str, Any] | None = None  # a PEFT config's module record: the weight sketch is filled in


_UNSET_A = (
    "its PLATE A was made on the meta device and has had no values since (to_empty() leaves it uninitialised): "
    "call plate_inspect.finish_meta_init(model) once the weights are loaded (it checks them, reloads "
    "B/Q and zeroes A), or load a state dict that holds A"
)


@runtime_checkable
class AwaitsWeights(Protocol):
    """A PLATE layer that can hold branches made on meta-device weights (PlateLinear, the PEFT PlateLayer):
    ``_awaiting`` maps A's name to what its branch owes; ``settle`` pays it."""

    _awaiting: dict[str, AwaitingWeights]

    def settle(self, zero_a: bool) -> None:
        """Pay what the branches owe once the weights are loaded (check them, reload B/Q, see to A)."""

    def get_parameter(self, target: str) -> nn.Parameter:
        """nn.Module's: the parameter at a dotted path (where a branch's A lives)."""


def settle_branch(
    layer: nn.Module, base: nn.Module, a_key: str, awaiting: AwaitingWeights, zero_a: bool
) -> tuple[WeightSketch | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Check a branch's now-loaded weight, read its B/Q again (as stored; None when the bundle is None: a state
    dict carries them), zero or check A; returns (the weight's sketch or None, (B, Q) or None).

    ``a_key``: A's name in ``layer`` (``plate_A``, or ``plate_A.<adapter>`` for the PEFT layer).
    """
    name = awaiting.name
    weight = layer_weight(base)
    if is_meta_tensor(weight):
        raise BundleError(
            f"module '{name}': its weight is still on the meta device; load the weights (to_empty() + "
            "load_state_dict or set_model_state_dict) before the first forward or finish_meta_init(model)"
        )
    sketch = None
    if awaiting.check_fingerprint:
        try:
            sketch = check_weight(
                base, name, awaiting.record, layout_of(base), awaiting.reference, awaiting.bundle, awaiting.adapter
            )
        except BundleError as e:
            raise BundleError(
                f"{e} (the layer was made while the weights were on the meta device: were they loaded after "
                "to_empty()? it leaves them uninitialised)"
            ) from None
        entry = awaiting.record_entry
        if entry is not None and entry.get("sketch") is None:
            entry["sketch"] = sketch.to_json()
    geometry = None
    if awaiting.bundle is not None:
        geometry = module_geometry(awaiting.bundle, awaiting.bundle_module, awaiting.k, q_dtype=None)
        if geometry_digest(*geometry) != awaiting.digest:
            raise BundleError(
                f"module '{name}': B/Q in {awaiting.bundle.path} changed since the PLATE layer was made (rescanned "
                "in place?); make the PLATE model again"
            )
    a = layer.get_parameter(a_key)
    if zero_a and not is_meta_tensor(a):
        with torch.no_grad():
            a.zero_()  # in place: a sharded A stays sharded, an optimizer made already keeps it
    elif zero_a and not hasattr(a, "to_local"):
        parent, _, leaf = a_key.rpartition(".")  # loaded with assign=True, never to_empty(): a new zero A
        zero = nn.Parameter(torch.zeros_like(a, device=weight.device), requires_grad=a.requires_grad)
        setattr(layer.get_submodule(parent), leaf, zero)
    elif zero_a:
        raise BundleError(f"module '{name}': A is sharded on the meta device; call model.to_empty(device=...) first")
    elif not awaiting.a_loaded:
        raise BundleError(f"module '{name}': {_UNSET_A}")
    return sketch, geometry


def note_loaded_a(
    module: AwaitsWeights, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *args: Any
) -> None:
    """load_state_dict pre-hook: a state dict that holds a meta-made A gives it values (into a materialised A, or
    with ``assign=True``, as accelerate's FSDP2 loading does)."""
    assign = bool(local_metadata.get("assign_to_params_buffers"))
    for key, awaiting in module._awaiting.items():
        if prefix + key in state_dict and (assign or not is_meta_tensor(module.get_parameter(key))):
            awaiting.a_loaded = True


def finish_meta_init(model: nn.Module) -> int:
    """Finish the PLATE layers made while the model's weights were on the meta device; returns how many it finished.

    Call it once the weights are loaded (after ``to_empty()`` + ``load_state_dict`` / ``set_model_state_dict``;
    on every rank of a sharded model: the check gathers full weights). Each such layer's weight is checked against
    the bundle, B/Q are read again from it, and A is zeroed (PLATE's start). Create the optimizer after this call.
    Without it, the first forward checks the weights and reloads B/Q, and needs A from a state dict.
    """
    done = 0
    for module in model.modules():
        if isinstance(module, AwaitsWeights) and module._awaiting:
            done += len(module._awaiting)
            module.settle(zero_a=True)
    return done


# --------------------------------------------------------------------------- bundle -> model
def resolve_module_names(model: nn.Module, names: list[str], strict: bool = True) -> dict[str, str]:
    """Bundle (checkpoint) module names -> the model's module names.

    Exact match first; then the name transformers' own checkpoint renamings give it (a VL wrapper saved as
    ``language_model.model.layers.0...`` loads as ``model.language_model.layers.0...``); otherwise a unique module
    whose name ends with ``.<name>`` (model wraps the checkpoint's base model, e.g. ``transformer.h.0.attn.c_attn``
    for ``h.0.attn.c_attn``) or the unique one that ``<name>`` ends with (checkpoint carries a prefix the model
    lacks, e.g. ``model.layers.0...`` into a bare ``Qwen2Model``).
    ``strict=False``: names with no unique match are left out (the caller decides whether it needs them).
    """
    modules = dict(model.named_modules())
    renamed = _renamed_by_transformers(model, [n for n in names if n not in modules])
    out: dict[str, str] = {}
    for name in names:
        if name in modules:
            out[name] = name
            continue
        if renamed.get(name) in modules:
            out[name] = renamed[name]
            continue
        cands = [m for m in modules if m.endswith("." + name)] or [m for m in modules if m and name.endswith("." + m)]
        if len(cands) == 1:
            out[name] = cands[0]
        elif cands:
            raise BundleError(
                f"bundle module '{name}': {len(cands)} modules of the model ({', '.join(cands[:3])}...) match this "
                "name; pass the model whose module names are the checkpoint's (e.g. the full ...ForCausalLM)"
            )
    missing = [n for n in names if n not in out]
    if strict and missing:
        raise unresolved_modules(model, missing, len(out))
    return out


def _renamed_by_transformers(model: nn.Module, names: list[str]) -> dict[str, str]:
    """{checkpoint module name: the model's name for it} by transformers' checkpoint renamings for this model (those
    it applies when loading the checkpoint; empty for a model that is no transformers model)."""
    renamings, _ = transformers_conversions(model)
    if not renamings or not names:
        return {}
    from transformers.core_model_loading import rename_source_key

    out = {}
    for name in names:
        key, _ = rename_source_key(f"{name}.weight", renamings, [])
        if key != f"{name}.weight" and key.endswith(".weight"):
            out[name] = key.removesuffix(".weight")
    return out


def unresolved_modules(
    model: nn.Module, missing: list[str], resolved: int, experts: frozenset[str] = frozenset()
) -> BundleError:
    """The refusal for bundle modules the model has no layer for: another model, or layers transformers fuses.

    ``experts``: the missing ones that are experts of fused 3-D parameters (which apply_bundle adapts and the PEFT
    method does not yet)."""
    fused = [n for n in missing if n in experts]
    if fused:
        first = f"bundle module '{fused[0]}'" + (f" (and {len(fused) - 1} more)" if len(fused) > 1 else "")
        return BundleError(
            f"{first}: an expert the model ({type(model).__name__}) holds inside a fused 3-D parameter; PLATE adapts "
            "fused experts via apply_bundle(model, bundle), the PEFT method does not yet: use apply_bundle, or adapt "
            "the other modules with PEFT (target_modules=['q_proj', ...])"
        )
    first = f"bundle module '{missing[0]}'" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    if not resolved:
        return BundleError(
            f"{first}: no module of the model ({type(model).__name__}) matches this name; the bundle was made for "
            "another model: scan this model's checkpoint (plate-inspect scan)"
        )
    return BundleError(
        f"{first}: the model ({type(model).__name__}) has no Linear/Conv1D layer of that name, though it has "
        f"{resolved} of the bundle's other modules, and no fused expert parameter that transformers' conversion "
        "mapping builds from it: adapt the others (target_modules / modules=['q_proj', ...]) or rescan with "
        "--target-modules that leave them out"
    )


def offload_hook(module: nn.Module) -> Any | None:
    """accelerate's hook that offloads the module's weights (``device_map`` with cpu/disk offload: the module holds
    them on the meta device between calls and the hook brings them in for each call), or None."""
    hook = getattr(module, "_hf_hook", None)
    return next((h for h in getattr(hook, "hooks", (hook,)) if getattr(h, "offload", False) is True), None)


def is_offloaded(module: nn.Module, model: nn.Module | None = None) -> bool:
    """True when accelerate offloads the module's weights. ``model``: the model it is in; peft's
    ``from_pretrained`` removes the hooks before it adds the adapter (and dispatches again after loading), so there
    a meta weight in a model whose ``hf_device_map`` offloads tells it."""
    if offload_hook(module) is not None:
        return True
    device_map = getattr(model, "hf_device_map", None)
    offloading = isinstance(device_map, dict) and bool({"cpu", "disk"} & {str(d) for d in device_map.values()})
    return offloading and is_meta_tensor(layer_weight(module))


@contextmanager
def onloaded(module: nn.Module) -> Iterator[None]:
    """The module's offloaded weights brought in for the block, as its accelerate hook does for a call, and
    offloaded again after (unchanged: writing back is peft's ``onload_layer``); nothing for any other module."""
    hook = offload_hook(module)
    if hook is None or not is_meta_tensor(layer_weight(module)):
        yield
        return
    hook.pre_forward(module)
    try:
        yield
    finally:
        hook.post_forward(module, torch.tensor([]))


def refuse_offloaded(module: nn.Module, name: str, model: nn.Module | None = None) -> None:
    """BundleError for a layer whose weight accelerate holds offloaded now: its meta weight is no model made on the
    meta device (no ``to_empty()`` + load will come). The PEFT method brings the weight in (``onloaded``) for the
    check and merges; apply_bundle does not, and ``PeftModel.from_pretrained`` has taken the hooks away."""
    if not (is_offloaded(module, model) and is_meta_tensor(layer_weight(module))):
        return
    if offload_hook(module) is not None:
        raise BundleError(
            f"module '{name}': accelerate offloads its weight (device_map put its layer on 'cpu' or 'disk' with "
            "offload), and apply_bundle needs it in memory: adapt an offloaded model with the PEFT method "
            "(get_peft_model(model, PlateConfig(bundle=...)) brings the weight in to check it and to merge), or "
            "load the model with a device_map that keeps the adapted layers on a device"
        )
    raise BundleError(
        f"module '{name}': accelerate offloads its weight (device_map put its layer on 'cpu' or 'disk' with "
        "offload), and PeftModel.from_pretrained has taken the model's offload hooks away (peft's offload "
        "bookkeeping would then rewrite the base checkpoint's file): load the base model again and add the saved "
        "adapter with get_peft_model(model, PlateConfig.from_pretrained(DIR)) + set_peft_model_state_dict(model, "
        "load_file(DIR/adapter_model.safetensors)), or load it with a device_map that keeps the adapted layers on a "
        "device"
    )


def refuse_quantized(module: nn.Module, name: str) -> None:
    """BundleError for a layer holding quantized codes (bitsandbytes ``Linear4bit``/``Linear8bitLt``: a uint8/int8
    weight, 4-bit packed to another shape): the weight check and merging need the full-precision weight. Without the
    check such a layer was refused as "another model" (4-bit) or "other weights, rescan" (8-bit), and with
    ``check_fingerprints=False`` an 8-bit one took merges into its int8 codes (a wrong model, silently)."""
    weight = layer_weight(module)
    if not weight.is_floating_point():
        raise BundleError(
            f"module '{name}': its weight is quantized ({type(module).__name__} holds {weight.dtype} codes, as "
            "bitsandbytes' 4-/8-bit layers do); PLATE checks the weight against the bundle and merges into it, "
            "which needs the full-precision weight: load the model without quantization_config (for less memory: "
            "dtype=torch.bfloat16)"
        )


def check_module_against_record(
    module: nn.Module,
    name: str,
    record: WeightRecord,
    check_fingerprint: bool = True,
    reference: WeightSketch | None = None,
    bundle: Bundle | None = None,
    adapter: bool = False,
) -> WeightSketch | None:
    """Refuse a module whose layout, shape or weights differ from what the bundle was made for.

    Returns the weight's reference sketch (to record in an adapter), or None when the fingerprint check is skipped.
    A rounded copy of the bundle's weights (model cast to a narrower dtype) passes: see ``weightcheck``.
    """
    if isinstance(module, PlateLinear) or hasattr(module, "base_layer"):
        how = "unload(model)" if isinstance(module, PlateLinear) else "merge_and_unload() or unload()"
        raise BundleError(
            f"module '{name}' is already wrapped ({type(module).__name__}); use one PLATE route per model "
            f"(apply_bundle or the PEFT method; several PEFT adapters: add_adapter), or {how} first"
        )
    refuse_quantized(module, name)
    refuse_offloaded(module, name)
    layout = layout_of(module)
    shape = list(oriented_shape(module))
    if shape != list(record.shape):
        raise BundleError(
            f"module '{name}': the bundle was made for [d_out, d_in] = {list(record.shape)} but the model's "
            f"{layout} weight is {shape}; this bundle belongs to another model"
        )
    if not check_fingerprint:
        return None
    if is_meta_tensor(layer_weight(module)):
        raise BundleError(
            f"module '{name}': its weight is on the meta device (not loaded yet); load the weights first "
            "(from_pretrained, or to_empty() + load_state_dict)"
        )
    return check_weight(module, name, record, layout, reference=reference, bundle=bundle, adapter=adapter)


def load_plan(plan: dict[str, Any] | str | os.PathLike | None, bundle: Bundle) -> dict[str, int]:
    """A plate-plan (dict or JSON file) as {bundle module: k}; checked against the bundle (identity, names, k range)."""
    if plan is None:
        return {}
    where = "plan"
    if not isinstance(plan, dict):
        if not isinstance(plan, (str, os.PathLike)) or not os.fspath(plan):
            raise ConfigError(f"plan must be a plate-plan (a dict or a JSON file's path) or None, got {plan!r:.80}")
        where = str(plan)
        try:
            plan = json.loads(Path(plan).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{where}: cannot read the plan ({e})") from None
    if not isinstance(plan, dict):  # JSON that is a list, a number, a string: no 'format' to name
        raise ConfigError(
            f"{where}: not a plate-plan (a JSON {type(plan).__name__}, not an object); make one with plate-inspect plan"
        )
    if plan.get("format") != PLAN_FORMAT or plan.get("format_version") != 1:
        raise ConfigError(f"{where}: not a plate-plan version 1 (format {plan.get('format')!r})")
    recorded = plan.get("bundle")
    identity = recorded.get("identity") if isinstance(recorded, dict) else None
    # the content identity (settings + every weight's fingerprint); a layout-only signature only for bundles
    # written before identities existed, which have nothing better
    expected = bundle.manifest.identity or bundle.manifest.source_signature
    if identity != expected:
        raise ConfigError(
            f"{where}: the plan was made for bundle {str(identity)[:31]!r}, not {bundle.path} "
            f"(identity {expected[:31]}...); make the plan from this bundle (plate-inspect plan)"
        )
    modules = plan.get("modules")
    if not isinstance(modules, dict):
        raise ConfigError(f"{where}: 'modules' must map module names to {{'k': int}}")
    out = {}
    for name, entry in modules.items():
        if name not in bundle:
            raise ConfigError(f"{where}: module '{name}' is not in the bundle {bundle.path}")
        k = entry.get("k") if isinstance(entry, dict) else None
        top = bundle.record(name).k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= top:
            raise ConfigError(f"{where}: module '{name}': k must be an integer in 1..{top} (the bundle's k), got {k!r}")
        out[name] = k
    return out


def module_geometry(
    bundle: Bundle, name: str, k: int | None = None, q_dtype: torch.dtype | None = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q[:, :k]) of one bundle module: Q's columns ascend in energy, so a prefix is the bottom-k eigenspace."""
    q = bundle.q(name, dtype=q_dtype)
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= q.shape[1]:
            raise ConfigError(f"module '{name}': k must be an integer in 1..{q.shape[1]} (the bundle's k), got {k!r}")
        q = q[:, :k].contiguous()
    return bundle.b_idx(name), q


def _as_bundle(bundle: Bundle | str | os.PathLike) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


#: a transformers model's checkpointing switches (4.x: gradient_*; 5.x: activation_*, and the old name until v6)
CHECKPOINTING_ENABLE = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


def require_input_grads(model: nn.Module) -> None:
    """``model.enable_input_require_grads()``, once per model: its input embeddings' output then requires grad.

    Why: reentrant checkpointing (transformers 4.x's default, ``use_reentrant=True``) gives a checkpointed block's
    output a gradient only when one of its inputs requires grad; with the base model frozen none does, so no gradient
    reaches A ("element 0 of tensors does not require grad"). peft does the same for its own methods when the model
    is already checkpointed at ``get_peft_model`` (``_prepare_model_for_gradient_checkpointing``), transformers 4.x
    when it holds the adapter itself (``add_adapter``), transformers 5 for every model taking ``input_ids``. Models
    without input embeddings are left as they are (only ``use_reentrant=False`` trains them)."""
    enable = getattr(model, "enable_input_require_grads", None)
    if model.__dict__.get("_plate_input_grads") or enable is None:
        return
    try:
        enable()
    except (NotImplementedError, AttributeError):  # no input embeddings (transformers 4.x raises)
        return
    model.__dict__["_plate_input_grads"] = True


@dataclass(frozen=True, eq=False)
class CheckpointingWithInputGrads:
    """A model's checkpointing switch (``enable``) that then calls :func:`require_input_grads` on ``model``: what
    ``PlateModel`` hands out for the wrapped model's switch (as the Trainer reaches it) and what ``apply_bundle``
    puts on the model itself. A plain object holding the model, so a deep copy or a pickle of the model keeps it
    bound to its own model."""

    model: nn.Module = field(repr=False)
    enable: Callable[..., Any] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "__doc__", getattr(self.enable, "__doc__", None))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Switch checkpointing on through the wrapped ``enable``, then make the model's inputs require grad."""
        out = self.enable(*args, **kwargs)
        require_input_grads(self.model)
        return out


def keep_input_grads_under_checkpointing(model: nn.Module) -> None:
    """For ``apply_bundle``'s model, what the PEFT path does: input grads now if the model is checkpointed already,
    and when its checkpointing switch is called later (5.x's ``activation_checkpointing_enable``, which the
    deprecated ``gradient_*`` name calls, or 4.x's ``gradient_checkpointing_enable``; the class's own switch is
    wrapped once, on the instance). Only one name is wrapped: transformers 5 takes a ``gradient_*`` on the instance
    for an override and would route ``activation_*`` through it (a FutureWarning per call)."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        require_input_grads(model)
    gradient, activation = CHECKPOINTING_ENABLE
    name = activation if callable(getattr(type(model), activation, None)) else gradient
    switch = getattr(model, name, None)
    if callable(switch) and not isinstance(switch, CheckpointingWithInputGrads):
        model.__dict__[name] = CheckpointingWithInputGrads(model, switch)


def apply_bundle(
    model: nn.Module,
    bundle: Bundle | str | os.PathLike,
    rho: float = 0.5,
    modules: list[str] | None = None,
    check_fingerprints: bool = True,
    *,
    q_dtype: torch.dtype | None = torch.float32,
    plan: dict[str, Any] | str | os.PathLike | None = None,
    references: dict[str, WeightSketch] | None = None,
) -> list[nn.Parameter]:
    """Wrap every bundle module (or the ``modules`` subset) in a PlateLinear; freeze the rest; return the A's.

    Before wrapping, each module's weight must be the one the bundle was made for (exact fingerprint, or a rounded
    copy of it: see ``weightcheck``); a mismatch raises BundleError naming the module and nothing is wrapped.
    ``check_fingerprints=False`` skips that check, with a warning. ``modules``: bundle module names or name suffixes
    (``"q_proj"``; one may be given as a string). ``q_dtype``: the dtype the layers hold Q in (None: as the bundle
    stores it); B/Q's digest is the bundle's whatever it is. ``plan`` (a plate-plan dict or JSON path) sets a
    smaller k per module (Q[:, :k]); ``references`` are recorded weight sketches (from an adapter). Calling it
    again for other modules (another rho, say) keeps the earlier calls' A's trainable. Reentrant checkpointing
    trains the A's as on a PeftModel: ``keep_input_grads_under_checkpointing``.
    """
    model_argument(model, "apply_bundle")
    rho = check_rho(rho)
    q_dtype_argument(q_dtype)
    bool_argument(check_fingerprints, "check_fingerprints")
    if references is not None and not isinstance(references, dict):
        raise ConfigError(f"references must be a dict of weight sketches by module name, got {references!r:.80}")
    b = _as_bundle(bundle)
    names = _module_names(modules, b)
    ks = load_plan(plan, b)
    mapping = resolve_module_names(model, names, strict=False)
    missing = [n for n in names if n not in mapping]
    slots = resolve_expert_slots(model, missing, b) if missing else {}
    if len(slots) < len(missing):  # neither a layer nor an expert of a fused parameter
        raise unresolved_modules(model, [n for n in missing if n not in slots], len(mapping) + len(slots))
    if not check_fingerprints:
        warnings.warn(
            "apply_bundle: fingerprint check skipped; a bundle made for other weights would go unnoticed",
            stacklevel=2,
        )
    fused, expert_sketches = {}, {}
    for name, slot in slots.items():  # checked (and oriented) before anything is wrapped, as the layers below
        ref = (references or {}).get(name)
        owner = model.get_submodule(slot.owner)
        base = owner.base if isinstance(owner, PlateExperts) else owner
        if offload_hook(base) is not None:
            raise BundleError(
                f"module '{slot.owner}': accelerate offloads its experts (device_map with cpu/disk offload), and "
                "PLATE on fused experts needs them in memory: load the model with a device_map that keeps them on a "
                "device"
            )
        fused[name] = getattr(base, slot.param)
        slots[name], sketch = check_expert_against_record(
            slot, fused[name], b.record(name), check_fingerprints, ref, b, adapter=references is not None
        )
        expert_sketches[name] = sketch or ref
    targets, sketches, waiting = {}, {}, set()
    for name in mapping:
        mod = model.get_submodule(mapping[name])
        if isinstance(mod, PlateLinear):
            raise BundleError(f"module '{mapping[name]}' is already a PLATE layer; merge or unload it first")
        ref = (references or {}).get(name)
        meta = is_meta_tensor(getattr(mod, "weight", torch.empty(0)))  # checked once loaded: AwaitingWeights
        sketches[name] = check_module_against_record(
            mod, mapping[name], b.record(name), check_fingerprints and not meta, ref, b, adapter=references is not None
        )
        if meta:
            sketches[name] = ref
            waiting.add(name)
        targets[name] = mod
    keep = {id(layer.plate_A) for layer in plate_layers(model).values() if layer.plate_A.requires_grad}
    keep |= {id(br.plate_A) for br in expert_branches(model).values() if br.plate_A.requires_grad}
    for p in model.parameters():
        if id(p) not in keep:  # the A's of an earlier apply_bundle call stay trainable
            p.requires_grad_(False)
    trainable = []
    identity = bundle_identity(b)
    for name, mod in targets.items():
        b_idx, q = module_geometry(b, name, ks.get(name), q_dtype=None)  # as stored: the digest is the bundle's
        digest = geometry_digest(b_idx, q)
        awaiting = None
        if name in waiting:
            awaiting = AwaitingWeights(
                mapping[name], b.record(name), check_fingerprints, sketches[name], b, name, ks.get(name), digest,
                adapter=references is not None,
            )  # fmt: skip
        layer = PlateLinear(
            mod, b_idx, q if q_dtype is None else q.to(q_dtype), rho=rho, digest=digest, awaiting=awaiting
        )
        layer.q_dtype = None if q_dtype is None else _dtype_name(q_dtype)
        layer.bundle_name = name
        layer.bundle_record_fingerprint = b.record(name).fingerprint
        layer.bundle_identity = identity
        layer.weight_sketch = sketches[name]
        _set_submodule(model, mapping[name], layer)
        trainable.append(layer.plate_A)
    for name, slot in slots.items():
        owner = model.get_submodule(slot.owner)
        if not isinstance(owner, PlateExperts):
            owner = PlateExperts(owner)
            _set_submodule(model, slot.owner, owner)
        b_idx, q = module_geometry(b, name, ks.get(name), q_dtype=None)
        branch = ExpertBranch(slot, b_idx, q if q_dtype is None else q.to(q_dtype), rho, fused[name].device)
        branch.geometry_digest = geometry_digest(b_idx, q)  # of B/Q as stored, as for the layers
        branch.q_dtype = None if q_dtype is None else _dtype_name(q_dtype)
        branch.bundle_record_fingerprint = b.record(name).fingerprint
        branch.bundle_identity = identity
        branch.weight_sketch = expert_sketches[name]
        owner.add(branch)
        trainable.append(branch.plate_A)
    keep_input_grads_under_checkpointing(model)
    return trainable


def _module_names(modules: list[str] | str | None, bundle: Bundle) -> list[str]:
    """``apply_bundle``'s ``modules``: None (every bundle module), or bundle module names or ``.``-separated name
    suffixes (``"q_proj"``: every bundle module ending in ``.q_proj``, peft's list rule), as a list or one string."""
    if modules is None:
        return list(bundle.modules)
    if isinstance(modules, str):
        modules = [modules]
    try:
        names = list(modules)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"modules must be a list of the bundle's module names (or one name), got {modules!r}")
    if not names:  # nothing would be wrapped, and every parameter frozen: a training run that learns nothing
        raise ConfigError("modules is empty: give the bundle's module names or name suffixes, or None for all of them")
    chosen: list[str] = []
    for n in names:
        matches = [n] if n in bundle else [m for m in bundle.modules if m.endswith("." + n)]
        if not matches:
            shown = ", ".join(bundle.modules[:3])
            raise BundleError(
                f"{bundle.path}: no module '{n}' in this bundle (it has {shown}, ...); modules takes bundle module "
                "names or name suffixes ('q_proj'); rescan with --target-modules/--layers that cover it"
            )
        chosen += [m for m in matches if m not in chosen]
    return chosen


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plate_layers(model: nn.Module) -> dict[str, PlateLinear]:
    """The model's PLATE layers by module name."""
    model_argument(model, "plate_layers")
    return {n: m for n, m in model.named_modules() if isinstance(m, PlateLinear)}


#: what a PeftModel offers for each of the functions below that act on apply_bundle's layers
PEFT_WAY = {
    "merge_all": "model.merge_adapter() (or merge_and_unload())",
    "unmerge_all": "model.unmerge_adapter()",
    "unload": "model.merge_and_unload() (model.unload() drops the adapters unmerged)",
    "save_adapter": "model.save_pretrained(DIRECTORY)",
}


def own_plate_layers(model: nn.Module, function: str) -> dict[str, PlateLinear]:
    """``plate_layers(model)`` for a function acting on apply_bundle's layers; a model whose PLATE layers are the
    PEFT method's is refused naming peft's own call (these functions found no layer there and returned as if
    done: ``unload`` handed back the PeftModel with its adapters in place)."""
    layers = plate_layers(model_argument(model, function))
    peft_module = sys.modules.get("plate_inspect.train.peft")  # not imported: no PEFT PLATE layer can exist
    if not layers and peft_module is not None:
        peft_layer = next((n for n, m in model.named_modules() if isinstance(m, peft_module.PlateLayer)), None)
        if peft_layer is not None:
            raise ConfigError(
                f"{function}: the model's PLATE layers are the PEFT method's ('{peft_layer}', ...), not "
                f"apply_bundle's; use {PEFT_WAY[function]}"
            )
    return layers


def merge_all(model: nn.Module) -> None:
    """merge() every PLATE layer and every adapted fused experts module."""
    for layer in own_plate_layers(model, "merge_all").values():
        layer.merge()
    for experts in plate_experts(model).values():
        experts.merge()


def unmerge_all(model: nn.Module) -> None:
    """unmerge() every PLATE layer and every adapted fused experts module."""
    for layer in own_plate_layers(model, "unmerge_all").values():
        layer.unmerge()
    for experts in plate_experts(model).values():
        experts.unmerge()


def unload(model: nn.Module, merge: bool = True) -> nn.Module:
    """Replace every PLATE layer by its base layer (merged first unless ``merge=False``); returns the model."""
    layers = own_plate_layers(model, "unload")
    bool_argument(merge, "merge")
    for name, layer in layers.items():
        if merge:
            layer.merge()
        else:
            layer.unmerge()
        layer._saved_rows = None
        _set_submodule(model, name, layer.base)
    for name, experts in plate_experts(model).items():
        if merge:
            experts.merge()
        else:
            experts.unmerge()
        _set_submodule(model, name, experts.base)
    for switch in CHECKPOINTING_ENABLE:  # apply_bundle's wrapped switch: a plain model again
        if isinstance(model.__dict__.get(switch), CheckpointingWithInputGrads):
            del model.__dict__[switch]
    return model


# --------------------------------------------------------------------------- adapter files
def bundle_identity(bundle: Bundle) -> dict[str, Any]:
    """What an adapter records about its bundle: path, source signature, per-module weight fingerprints."""
    m = bundle.manifest
    return {
        "bundle_path": str(Path(bundle.path).resolve()),
        "source": m.source,
        "source_signature": m.source_signature,
        "fingerprints": {n: rec.fingerprint for n, rec in m.modules.items()},
    }


def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write every PLATE layer's A (key ``<bundle module>.plate_A``) and the bundle's identity to a safetensors file.

    The metadata records per module the weight fingerprint, the B/Q digest, k, rho, the dtype Q was held in and the
    weight's reference sketch (so the adapter still loads into a model cast to a narrower dtype).
    """
    from safetensors.torch import save_file

    model_argument(model, "save_adapter")
    path = path_argument(path, "path")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give save_adapter a file path, e.g. {path / 'adapter.safetensors'}")
    refuse_to_replace(
        path, _is_adapter_file, "a PLATE adapter", "the adapter", "path", str(path.with_name("adapter.safetensors"))
    )
    layers: dict[str, PlateLinear | ExpertBranch] = {**own_plate_layers(model, "save_adapter")}
    layers.update(expert_branches(model))
    if not layers:
        raise ConfigError("the model has no PLATE layers to save; call apply_bundle first")
    tensors, digests, fingerprints, ks, sketches, rhos, q_dtypes = {}, {}, {}, {}, {}, {}, {}
    for layer in layers.values():
        name = getattr(layer, "bundle_name", None)
        if name is None:
            raise ConfigError("a PLATE layer was not created by apply_bundle; cannot record its bundle identity")
        tensors[f"{name}.plate_A"] = layer.plate_A.detach().to("cpu").contiguous()
        digests[name] = layer.geometry_digest
        fingerprints[name] = layer.bundle_record_fingerprint
        ks[name] = layer.k
        rhos[name] = layer.rho
        q_dtypes[name] = getattr(layer, "q_dtype", "float32")
        sketch = getattr(layer, "weight_sketch", None)
        if sketch is not None:
            sketches[name] = sketch.to_json()
    identity = next(iter(layers.values())).bundle_identity  # every layer has one (it has a bundle_name)
    uniform = len(set(rhos.values())) == 1
    meta = {
        "format": ADAPTER_FORMAT,
        "format_version": str(ADAPTER_VERSION),
        "bundle_path": identity["bundle_path"],
        "source_signature": identity["source_signature"],
        "source": json.dumps(identity["source"]),
        "fingerprints": json.dumps(fingerprints),
        "plate_digests": json.dumps(digests),
        "k": json.dumps(ks),
        "weight_sketches": json.dumps(sketches),
        "rho": repr(next(iter(rhos.values()))) if uniform else json.dumps(rhos),  # per module when they differ
        "q_dtypes": json.dumps(q_dtypes),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def _is_adapter_file(path: Path) -> bool:
    """Whether ``path`` is a safetensors file save_adapter wrote (an earlier adapter: it may be replaced)."""
    from plate_inspect.checkpoint import parse_safetensors_header
    from plate_inspect.errors import PlateInspectError

    try:
        return parse_safetensors_header(path)[1].get("format") == ADAPTER_FORMAT
    except PlateInspectError:  # not a readable safetensors file, so not ours
        return False


def _not_a_plate_file(path: Path) -> BundleError:
    """The error for a PEFT adapter (directory or its safetensors file) or a directory given as an adapter file."""
    folder = path if path.is_dir() else path.parent
    config = folder / "adapter_config.json"
    if config.exists():
        try:
            kind = json.loads(config.read_text()).get("peft_type") or "PEFT"
        except (OSError, ValueError, AttributeError):
            kind = "PEFT"
        return BundleError(
            f"{path}: this is a PEFT adapter ({kind}, written by save_pretrained), not a plate-adapter file; "
            f"load it with PeftModel.from_pretrained(base, '{folder}') (import plate_inspect.train.peft first) and "
            "call merge_and_unload() then save_pretrained(dir) for a merged model; plate-inspect merge and "
            "load_adapter take a file written by save_adapter"
        )
    return BundleError(f"{path}: is a directory; pass the adapter file written by save_adapter (*.safetensors)")


def read_adapter(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(A tensors by bundle module name, metadata with JSON fields decoded; ``rhos``/``q_dtypes`` per module)."""
    from safetensors import safe_open

    path = path_argument(path, "path")
    if not path.exists():
        raise BundleError(f"{path}: adapter file not found")
    if path.is_dir():
        raise _not_a_plate_file(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k.removesuffix(".plate_A"): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise BundleError(
            f"{path}: not a readable safetensors adapter ({e}): truncated or not a safetensors file; give the file "
            "save_adapter wrote (copy it again if it was cut short)"
        ) from None
    if meta.get("format") != ADAPTER_FORMAT:
        if (path.parent / "adapter_config.json").exists():
            raise _not_a_plate_file(path)
        raise BundleError(f"{path}: not a PLATE adapter (format {meta.get('format')!r})")
    try:
        for key in ("fingerprints", "plate_digests", "source", "k", "weight_sketches", "q_dtypes"):
            meta[key] = json.loads(meta.get(key, "null") or "null")
        meta["weight_sketches"] = {n: WeightSketch.from_json(d) for n, d in (meta["weight_sketches"] or {}).items()}
        meta["k"] = meta["k"] or {}
        meta["q_dtypes"] = meta["q_dtypes"] or {}  # adapters written before q_dtypes: apply_bundle's float32
        meta["rhos"] = _read_rhos(meta.get("rho", "0.5"), list(tensors))
        uniform = set(meta["rhos"].values())
        meta["rho"] = uniform.pop() if len(uniform) == 1 else None  # one rho for every module, else see rhos
    except (ValueError, TypeError, KeyError, AttributeError, ConfigError) as e:
        raise BundleError(f"{path}: corrupt adapter metadata ({e})") from None
    return tensors, meta


def _read_rhos(raw: str, names: list[str]) -> dict[str, float]:
    """The adapter's rho per module: one number for all (every adapter before per-module rho) or a JSON object."""
    try:
        return {n: check_rho(float(raw)) for n in names}
    except ValueError:
        rhos = json.loads(raw)
    return {n: check_rho(rhos[n]) for n in names}


def adapter_q_dtype(name: str | None) -> torch.dtype | None:
    """The dtype an adapter records its layers held Q in (its ``q_dtypes`` metadata); None for None."""
    dtype = getattr(torch, name) if isinstance(name, str) else None
    if name is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise BundleError(f"adapter metadata: q_dtype {name!r} is not a floating torch dtype (corrupt adapter)")
    return dtype


def adapter_plan(meta: dict[str, Any], bundle: Bundle) -> dict[str, Any] | None:
    """The plan that reproduces an adapter's per-module k (None when every module uses the bundle's k)."""
    smaller = {n: {"k": int(k)} for n, k in meta["k"].items() if n in bundle and int(k) != bundle.record(n).k}
    if not smaller:
        return None
    identity = {"identity": bundle.manifest.identity or bundle.manifest.source_signature}
    return {"format": PLAN_FORMAT, "format_version": 1, "bundle": identity, "modules": smaller}


def _check_adapter_bundle(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], bundle: Bundle) -> None:
    """Refuse a bundle the adapter was not made with (names, weight fingerprints, r and k) before anything is built."""
    other = f"{path}: this adapter was made with bundle {meta.get('bundle_path')}, and {bundle.path} is another one"
    fix = "pass the bundle it was trained with (bundle=...)"
    for name, a in tensors.items():
        if name not in bundle:
            raise BundleError(f"{other} (it has no module '{name}'); {fix}")
        rec = bundle.record(name)
        if meta["fingerprints"].get(name) != rec.fingerprint:
            raise BundleError(f"{other} (made for other weights: module '{name}' fingerprint differs); {fix}")
        if a.ndim != 2 or a.shape[0] != rec.r or not 1 <= a.shape[1] <= rec.k:
            raise BundleError(
                f"{other} (module '{name}': A is {list(a.shape)}, this bundle has r = {rec.r}, k <= {rec.k}); {fix}"
            )


def load_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    bundle: Bundle | str | os.PathLike | None = None,
    check_fingerprints: bool = True,
) -> list[nn.Parameter]:
    """Load a saved adapter into the model's PLATE layers (applying its bundle first if the model has none).

    Refuses (BundleError) an adapter whose weight fingerprints, B/Q geometry or shapes differ from the layers'; a
    refused load leaves the model as it was.
    """
    model_argument(model, "load_adapter")
    tensors, meta = read_adapter(path)
    path = Path(path)
    layers = adapter_layers(model)
    grads = {id(p): p.requires_grad for p in model.parameters()}
    created = not layers
    try:
        if created:
            if bundle is None and not Path(meta["bundle_path"]).exists():
                raise BundleError(
                    f"{path}: the bundle this adapter was made with, {meta['bundle_path']}, is not there (moved or "
                    "deleted?); pass its new place: load_adapter(model, ADAPTER, bundle=BUNDLE_DIR)"
                )
            b = _as_bundle(bundle if bundle is not None else meta["bundle_path"])
            _check_adapter_bundle(path, tensors, meta, b)
            groups: dict[str | None, list[str]] = {}  # apply_bundle once per dtype Q was held in
            for name in tensors:
                groups.setdefault(meta["q_dtypes"].get(name, "float32"), []).append(name)
            for q_name, names in groups.items():
                apply_bundle(
                    model,
                    b,
                    rho=meta["rhos"][names[0]],
                    modules=names,
                    check_fingerprints=check_fingerprints,
                    q_dtype=adapter_q_dtype(q_name),
                    plan=adapter_plan(meta, b),
                    references=meta["weight_sketches"],
                )
            layers = adapter_layers(model)
        return _load_a(layers, tensors, meta, path)
    except BaseException:
        if created:  # put the plain layers back and restore requires_grad: the model is as it was
            for name, layer in plate_layers(model).items():
                _set_submodule(model, name, layer.base)
            for name, experts in plate_experts(model).items():
                _set_submodule(model, name, experts.base)
            for p in model.parameters():
                p.requires_grad_(grads.get(id(p), p.requires_grad))
        raise


def adapter_layers(model: nn.Module) -> dict[str, PlateLinear | ExpertBranch]:
    """What an adapter file holds A's for: the PLATE layers (by module name) and the expert branches (by bundle
    module name)."""
    return {**plate_layers(model), **expert_branches(model)}


def _load_a(
    layers: dict[str, PlateLinear | ExpertBranch], tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Path
) -> list[nn.Parameter]:
    by_name = {getattr(layer, "bundle_name", n): layer for n, layer in layers.items()}
    if set(by_name) != set(tensors):
        extra = sorted(set(tensors) ^ set(by_name))
        raise BundleError(f"{path}: adapter modules and the model's PLATE layers differ (e.g. '{extra[0]}')")
    for name, a in tensors.items():
        layer = by_name[name]
        if meta["fingerprints"].get(name) != getattr(layer, "bundle_record_fingerprint", None):
            raise BundleError(f"{path}: adapter for module '{name}' was trained on other weights (fingerprint differs)")
        if meta["plate_digests"].get(name) != layer.geometry_digest:
            raise BundleError(
                f"{path}: adapter for module '{name}' was trained with another bundle (B/Q differ from those of "
                f"{meta.get('bundle_path')}, which it recorded)"
            )
        if tuple(a.shape) != tuple(layer.plate_A.shape):
            raise BundleError(f"{path}: A of '{name}' is {list(a.shape)}, the layer needs {list(layer.plate_A.shape)}")
        if is_meta_tensor(layer.plate_A):
            raise BundleError(
                f"{path}: the model's weights are on the meta device (module '{name}'), where A cannot take values; "
                "load the adapter once the weights are loaded (to_empty() + load_state_dict)"
            )
    with torch.no_grad():
        for name, a in tensors.items():
            layer = by_name[name]
            layer.plate_A.copy_(a.to(layer.plate_A.dtype))
            layer.rho = meta["rhos"][name]
            if "plate_A" in layer._awaiting:
                layer._awaiting["plate_A"].a_loaded = True
    return [by_name[n].plate_A for n in tensors]
