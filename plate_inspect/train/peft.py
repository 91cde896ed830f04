"""PLATE as a PEFT method: ``get_peft_model(model, PlateConfig(bundle="bundles/mine"))``.

Importing this module registers the method ``plate`` with peft's ``register_peft_method``. peft 0.21 only accepts
names that are members of its ``PeftType`` enum, so a ``PLATE`` member is added to that enum first (the one
intrusion into peft; it changes nothing else). After that ``get_peft_model``, ``print_trainable_parameters``,
``save_pretrained`` / ``PeftModel.from_pretrained`` (import ``plate_inspect.train.peft`` before loading),
``merge_and_unload``, several adapters (``add_weighted_adapter``: linear, exact over a shared B/Q) and the
transformers ``Trainer`` work as for LoRA.

The adapter layer keeps B and Q as buffers read from the bundle (non-persistent by default, so a saved adapter
holds only the A's; ``PlateConfig(carry_geometry=True)`` saves B and Q too, so the adapter loads without the
bundle). ``adapter_config.json`` records the bundle path (absolute, and relative to the adapter directory for an
adapter moved together with its bundle), its source signature, and per module the weight
fingerprint and sketch and the B/Q digest: loading refuses a bundle or base model that differs. The branch math is
``plate_inspect.train.core``'s, shared with ``PlateLinear``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import math
import numbers
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from peft.config import PeftConfig
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, check_adapters_to_merge, onload_layer
from peft.utils import PeftType, register_peft_method
from torch import nn

from plate_inspect.atomic import path_argument
from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.train.core import (
    add_branch,
    check_rho,
    dense_delta,
    geometry_digest,
    merge_rows,
    unmerge_rows,
    validate_geometry,
)
from plate_inspect.train.experts import (
    ExpertSlot,
    PlateExperts,
    adapted_parameter_rows,
    check_expert_against_record,
    resolve_expert_slots,
)
from plate_inspect.train.layer import (
    CHECKPOINTING_ENABLE,
    AwaitingWeights,
    CheckpointingWithInputGrads,
    check_module_against_record,
    compile_disabled,
    geometry_device,
    input_width_error,
    is_meta_tensor,
    layer_weight,
    layout_of,
    load_plan,
    module_geometry,
    note_loaded_a,
    offload_hook,
    onloaded,
    oriented_shape,
    output_may_be_held,
    refuse_offloaded,
    resolve_module_names,
    settle_branch,
    unresolved_modules,
)
from plate_inspect.train.weightcheck import WeightSketch

PEFT_NAME = "plate"


def _ensure_peft_type() -> PeftType:
    """Add ``PLATE`` to peft's PeftType enum (peft 0.21's registration only accepts enum members)."""
    if "PLATE" in PeftType.__members__:
        return PeftType["PLATE"]
    member = str.__new__(PeftType, "PLATE")
    member._name_ = "PLATE"
    member._value_ = "PLATE"
    add_member = getattr(PeftType, "_add_member_", None)  # Python >= 3.13
    if add_member is not None:
        add_member("PLATE", member)
    else:
        type.__setattr__(PeftType, "PLATE", member)
        PeftType._member_map_["PLATE"] = member
    if "PLATE" not in PeftType._member_names_:  # iteration (list(PeftType)) walks _member_names_
        PeftType._member_names_.append("PLATE")
    PeftType._value2member_map_["PLATE"] = member
    return member


PLATE_TYPE = _ensure_peft_type()


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_text_or_none(value: object) -> bool:
    return value is None or isinstance(value, str)


def _is_records_or_none(value: object) -> bool:
    return value is None or (
        isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, dict) for k, v in value.items())
    )


#: PlateConfig fields whose type nothing else checks before get_peft_model (where a wrong one failed as an
#: AttributeError, or a flag given as 'no', which is truthy, meant the opposite): field -> (accepts, what it takes).
#: LoraConfig checks none of these; PlateConfig refuses a wrong one at construction.
_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    "check_fingerprints": (_is_bool, "True or False"),
    "carry_geometry": (_is_bool, "True or False"),
    "inference_mode": (_is_bool, "True or False"),
    "bundle_signature": (_is_text_or_none, "a string or None (filled in when the adapter is created)"),
    "bundle_digest": (_is_text_or_none, "a string or None (filled in when the adapter is created)"),
    "bundle_relative": (_is_text_or_none, "a string or None (written by save_pretrained)"),
    "module_records": (
        _is_records_or_none,
        "a dict of per-module dicts or None (filled in when the adapter is created)",
    ),
}


def _modules_to_save(value: object) -> list[str] | None:
    """``modules_to_save`` as peft reads it: None or a list of module names (each matches the modules whose name ends
    with it). One string is one name, as everywhere in plate-inspect (peft would iterate it: 'head' became the
    one-letter names h, e, a, d, which train every module whose name ends in one of them); anything else, or an
    empty name (it matches every module), is a ConfigError."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if isinstance(names, (list, tuple, set, frozenset)) and all(isinstance(n, str) and n.strip() for n in names):
        return sorted(names) if isinstance(names, (set, frozenset)) else list(names)
    raise ConfigError(
        f"modules_to_save must be a list of module names (e.g. ['classifier']) or None, got {value!r:.80}"
    )


@dataclass
class PlateConfig(PeftConfig):
    """Configuration of a PLATE adapter: the bundle it is built from, rho, and optionally a subset of its modules."""

    # required: "" (or None) is refused in __post_init__, which makes it the absolute path as a str (a Bundle, as
    # scan() returns, is taken for its directory; typed as what the adapter holds)
    bundle: str | os.PathLike = field(
        default="", metadata={"help": "Path of the PLATE init bundle (from scan), or the Bundle scan() returns."}
    )
    rho: float = field(default=0.5, metadata={"help": "Scale of the update: W' = W + rho B A Q^T."})
    target_modules: list[str] | str | set[str] | None = field(
        default=None,
        metadata={
            "help": "Subset of the bundle's modules to adapt: a list of module names or name suffixes (the model's "
            "or the bundle's), or a string, which (as in peft) is a regular expression matching whole module names; "
            "None or 'all-linear': every module of the bundle. A list becomes a set (as in peft); once the adapter "
            "is made, the set of the model's module names it adapts."
        },
    )
    check_fingerprints: bool = field(
        default=True, metadata={"help": "Refuse a model whose weights differ from the ones the bundle was made for."}
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Other modules to train and save fully (e.g. a new task head)."}
    )
    plan: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "A plate-plan (dict or JSON path): a smaller k per module (Q[:, :k])."}
    )
    carry_geometry: bool = field(
        default=False,
        metadata={"help": "Save B (int) and Q (model dtype) with the adapter so it loads without the bundle."},
    )
    bundle_signature: str | None = field(
        default=None, metadata={"help": "Filled in when the adapter is created: the bundle's source signature."}
    )
    bundle_digest: str | None = field(
        default=None, metadata={"help": "Filled in when the adapter is created: digest of fingerprints and B/Q."}
    )
    module_records: dict[str, dict[str, Any]] | None = field(
        default=None,
        metadata={"help": "Filled in when the adapter is created: per module weight identity, B/Q digest, r, k."},
    )
    bundle_relative: str | None = field(
        default=None,
        metadata={
            "help": "Written by save_pretrained: the bundle's path relative to the adapter directory, used when "
            "`bundle` is not there (adapter and bundle moved together)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = PLATE_TYPE
        if not self.bundle:
            raise BundleError("PlateConfig needs bundle=<path of a PLATE init bundle> (make one: plate-inspect scan)")
        if isinstance(self.bundle, Bundle):  # what scan() returns, and apply_bundle takes: its directory
            self.bundle = self.bundle.path
        self.bundle = str(path_argument(self.bundle, "bundle").expanduser().resolve())
        self.rho = check_rho(self.rho)
        for name, (accepts, want) in _FIELD_TYPES.items():  # at construction, not as an AttributeError later
            if not accepts(getattr(self, name)):
                raise ConfigError(f"{name} must be {want}, got {getattr(self, name)!r:.80}")
        self.modules_to_save = _modules_to_save(self.modules_to_save)
        tm = self.target_modules
        if isinstance(tm, (list, tuple, set, frozenset)) and all(isinstance(t, str) for t in tm):
            self.target_modules = set(tm)
        elif isinstance(tm, str):
            try:
                re.compile(tm)
            except re.error as e:
                raise ConfigError(f"target_modules {tm!r}: a string is a regular expression; not this ({e})") from None
        elif tm is not None:
            raise ConfigError(f"target_modules must be a list of module names, a regex string or None, got {tm!r}")
        if self.plan is not None and not isinstance(self.plan, dict):
            if not isinstance(self.plan, (str, os.PathLike)) or not os.fspath(self.plan):
                raise ConfigError(
                    f"plan must be a plate-plan (a dict or a JSON file's path) or None, got {self.plan!r:.80}"
                )
            path = Path(self.plan)
            try:
                self.plan = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{path}: cannot read the plan ({e})") from None
            if not isinstance(self.plan, dict):
                raise ConfigError(
                    f"{path}: not a plate-plan (a JSON {type(self.plan).__name__}, not an object); make one with "
                    "plate-inspect plan"
                )

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """peft's, and ``bundle_relative``: the bundle seen from ``save_directory`` (this config is left as is)."""
        saved = copy.copy(self)
        try:
            saved.bundle_relative = os.path.relpath(self.bundle, Path(save_directory).expanduser().resolve())
        except ValueError:  # on another drive (Windows): no relative path
            saved.bundle_relative = None
        PeftConfig.save_pretrained(saved, os.fspath(save_directory), **kwargs)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, subfolder: str | None = None, **kwargs: Any
    ) -> PlateConfig:
        """peft's; a bundle that is no longer at its recorded absolute path is taken from ``bundle_relative`` seen
        from the adapter directory when it is there (adapter and bundle moved together; B/Q digests and weight
        fingerprints are checked as always)."""
        config = super().from_pretrained(str(pretrained_model_name_or_path), subfolder=subfolder, **kwargs)
        if isinstance(config, PlateConfig):
            moved = _moved_bundle(Path(pretrained_model_name_or_path, subfolder or ""), config)
            config.bundle = str(moved) if moved is not None else config.bundle
        return config


def _moved_bundle(folder: Path, config: PlateConfig) -> Path | None:
    """The bundle at ``bundle_relative`` from the adapter directory, when the recorded absolute path is gone."""
    relative = config.bundle_relative
    if relative is None or not folder.is_dir() or Path(config.bundle).exists() or not _relative_applies(config):
        return None
    found = (folder / relative).resolve()
    return found if found.exists() else None


def _relative_applies(config: PlateConfig) -> bool:
    """``bundle_relative`` holds for ``bundle`` as it was written with it (their last parts agree): a ``bundle``
    edited by hand is used as is."""
    tail = [part for part in Path(config.bundle_relative or "").parts if part not in ("..", ".")]
    return bool(tail) and list(Path(config.bundle).parts[-len(tail) :]) == tail


_RANK_HINT = (
    "r and k per module come from the bundle (plate-inspect scan --r/--tau/--max-rank; a smaller k per module: "
    "PlateConfig(plan=...))"
)
_MODULES_HINT = (
    "choose modules with target_modules (names or suffixes, or a regex over whole names such as "
    "r'.*\\.layers\\.(0|1)\\..*'), or scan only those layers (plate-inspect scan --layers 0-1)"
)
#: LoRA options people pass out of habit, with PLATE's way to get the same (``PlateConfig`` refuses them by name).
_LORA_OPTIONS = {
    "r": _RANK_HINT,
    "rank_pattern": _RANK_HINT,
    "target_r": _RANK_HINT,
    "lora_alpha": "the update's scale is rho (PlateConfig(rho=...))",
    "alpha_pattern": "the update's scale is rho (PlateConfig(rho=...)); per module family: one adapter per rho",
    "use_rslora": "the update's scale is rho (PlateConfig(rho=...))",
    "layers_to_transform": _MODULES_HINT,
    "layers_pattern": _MODULES_HINT,
    "exclude_modules": _MODULES_HINT,
    "init_lora_weights": "A starts at zero, so the model's output at init is the base model's",
}


def _refuse_lora_options(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap the dataclass __init__: a LoRA-only option gets one line naming PLATE's way instead of a TypeError."""

    def __init__(self: PlateConfig, *args: Any, **kwargs: Any) -> None:
        foreign = [k for k in kwargs if k in _LORA_OPTIONS]
        if foreign:
            k = foreign[0]
            raise ConfigError(f"PlateConfig has no option {k!r} (a LoRA option): {_LORA_OPTIONS[k]}")
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]  # a function takes any attribute
    return __init__


# the dataclass's own __init__, wrapped: type checkers keep its signature (hence assigning, not overriding)
PlateConfig.__init__ = _refuse_lora_options(PlateConfig.__init__)  # type: ignore[method-assign]


class _GeometryDict(BufferDict):
    """A BufferDict that saves (state_dict) only the buffers of the adapters that carry their geometry."""

    def __init__(self) -> None:
        super().__init__({}, persistent=False)
        self.carried: set[str] = set()

    def __setitem__(self, key: str, buffer: torch.Tensor) -> None:
        self.register_buffer(key, buffer, persistent=key in self.carried)


class PlateLayer(nn.Module, BaseTunerLayer):
    """A Linear/Conv1D with one PLATE branch per adapter name: y = base(x) + sum_a rho_a scatter_B((x Q_a) A_a^T)."""

    adapter_layer_names = ("plate_A",)
    other_param_names = ("plate_B_idx", "plate_Q", "plate_rho")
    module_name: str  # the model's name for it (set by PlateModel; named in its errors)

    def __init__(self, base_layer: nn.Module, adapter_name: str, geometry: BranchGeometry, rho: float) -> None:
        super().__init__()
        BaseTunerLayer.__init__(self)
        self.base_layer = base_layer
        self.layout = layout_of(base_layer)
        self.out_features, self.in_features = oriented_shape(base_layer)
        self.plate_A = nn.ParameterDict({})
        self.plate_B_idx = _GeometryDict()
        self.plate_Q = _GeometryDict()
        self.plate_rho: dict[str, float] = {}
        self.plate_digest: dict[str, str] = {}
        self.plate_carried: dict[str, frozenset[str]] = {}  # accepted digests of a carried (saved) B/Q
        self._pending: set[str] = set()  # carried geometry not loaded yet (placeholders)
        self._awaiting: dict[str, AwaitingWeights] = {}  # "plate_A.<adapter>": made on a meta-device weight
        self._saved_rows: dict[str, torch.Tensor] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self._active_adapter = adapter_name
        self._inplace = type(base_layer) is nn.Linear or self.layout == "conv1d"
        self.update_layer(adapter_name, geometry, rho)
        self.register_load_state_dict_pre_hook(_check_carried_geometry)
        self.register_load_state_dict_pre_hook(note_loaded_a)
        self.register_load_state_dict_post_hook(_carried_geometry_loaded)

    def update_layer(self, adapter_name: str, geometry: BranchGeometry, rho: float) -> None:
        """Add (or replace) one adapter: zero A [r, k], B indices, frozen Q (validated by the shared core).

        ``geometry.carried``: the digests a saved B/Q may have (the adapter carries its geometry; Q is held in the
        model's dtype); ``pending``: B/Q are placeholders that the adapter's state dict fills in; ``awaiting``: the
        base weight is on the meta device (B/Q wait on the CPU, A on meta, until ``settle``).
        """
        carried, pending, awaiting = geometry.carried, geometry.pending, geometry.awaiting
        weight = layer_weight(self.get_base_layer())
        b_idx, q = validate_geometry(
            geometry.b_idx, geometry.q, self.out_features, self.in_features, where=type(self).__name__
        )
        rho = check_rho(rho)
        for buffers in (self.plate_B_idx, self.plate_Q):
            (buffers.carried.add if carried is not None else buffers.carried.discard)(adapter_name)
        q_dtype = weight.dtype if carried is not None and weight.is_floating_point() else torch.float32
        self.plate_B_idx[adapter_name] = b_idx.to(geometry_device(weight.device))
        self.plate_Q[adapter_name] = q.to(geometry_device(weight.device), q_dtype).contiguous()
        self.plate_A[adapter_name] = nn.Parameter(torch.zeros(b_idx.numel(), q.shape[1], device=weight.device))
        self._awaiting.pop(f"plate_A.{adapter_name}", None)
        if awaiting is not None:
            self._awaiting[f"plate_A.{adapter_name}"] = awaiting
        self.plate_rho[adapter_name] = rho
        self.plate_digest[adapter_name] = geometry.digest
        self.plate_carried.pop(adapter_name, None)
        self._pending.discard(adapter_name)
        if carried is not None:
            self.plate_carried[adapter_name] = carried
            if pending:
                self._pending.add(adapter_name)
        self.set_adapter(self.active_adapters)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base output plus each active adapter's rho * B A Q^T x (merged: in the weight; disabled: none)."""
        if self._awaiting:
            self.settle(zero_a=False)
        if x.shape[-1] != self.in_features:  # as PlateLinear's: the layer and both widths, not torch's mat1/mat2
            raise input_width_error(getattr(self, "module_name", "PlateLayer"), x, self.in_features, self.out_features)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        base_out = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return base_out
        # in place into the base output only when nothing else holds it (a forward hook on the base layer may)
        own = self._inplace and not output_may_be_held(self.get_base_layer())
        result = base_out
        for name in (a for a in self.active_adapters if a in self.plate_A):
            result = add_branch(
                result,
                x,
                self.plate_B_idx[name],
                self.plate_Q[name],
                self.plate_A[name],
                self.plate_rho[name],
                inplace=own or result is not base_out,
            )
        return result

    @compile_disabled
    def settle(self, zero_a: bool) -> None:
        """Adapters made on meta-device weights, now loaded: check them, reload B/Q beside them, see to A."""
        base = self.get_base_layer()
        with torch.inference_mode(False):
            for key, awaiting in list(self._awaiting.items()):
                _, geometry = settle_branch(self, base, key, awaiting, zero_a)
                name, dev = key.removeprefix("plate_A."), layer_weight(base).device
                if geometry is not None:  # else carried: the adapter's state dict gives B/Q
                    b_idx, q = geometry
                    self.plate_B_idx[name] = b_idx.to(dev)
                    self.plate_Q[name] = q.to(dev, self.plate_Q[name].dtype).contiguous()
                del self._awaiting[key]

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """Dense rho B A Q^T in the base weight's stored layout ([d_out, d_in], or [d_in, d_out] for Conv1D)."""
        b, a, q = self.plate_B_idx[adapter], self.plate_A[adapter], self.plate_Q[adapter]
        return dense_delta(b, a, q, self.plate_rho[adapter], self.out_features, self.layout)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """W[B] += rho A Q^T for each active adapter; the replaced rows are kept so unmerge() is exact."""
        if self._awaiting:
            self.settle(zero_a=False)
        adapter_names = check_adapters_to_merge(self, adapter_names)
        with self._weight_in_memory():
            w = layer_weight(self.get_base_layer())
            for name in adapter_names:
                if name not in self.plate_A:
                    continue
                b, a, q = self.plate_B_idx[name], self.plate_A[name], self.plate_Q[name]
                old = merge_rows(w, self.layout, b, a, q, self.plate_rho[name])
                if safe_merge and not torch.isfinite(w).all():
                    unmerge_rows(w, self.layout, b, old)
                    raise ValueError(f"NaNs detected in the merged weights; the adapter {name} seems to be broken")
                self._saved_rows[name] = old
                self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo merge() exactly (restores the saved rows, last merged first)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        with self._weight_in_memory():
            w = layer_weight(self.get_base_layer())
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                unmerge_rows(w, self.layout, self.plate_B_idx[name], self._saved_rows.pop(name))

    def _weight_in_memory(self) -> contextlib.AbstractContextManager[Any]:
        """peft's ``onload_layer`` while accelerate holds the base weight offloaded (a merge outside peft's own
        merge calls, such as the unmerge a disabled adapter does): it brings the weight in and keeps what was
        written into it; nothing otherwise."""
        base = self.get_base_layer()
        offloaded = offload_hook(base) is not None and is_meta_tensor(layer_weight(base))
        return onload_layer(self) if offloaded else contextlib.nullcontext()

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """False: peft's conversion of an adapter to LoRA is not offered for PLATE layers."""
        return False

    def __repr__(self) -> str:
        return "plate." + super().__repr__()


@dataclass(frozen=True)
class ExpertGeometry:
    """One adapter's branch on one expert of a fused parameter, as PlateModel prepares it."""

    slot: ExpertSlot
    b_idx: torch.Tensor
    q: torch.Tensor
    digest: str


class _ExpertBuffers(nn.Module):
    """B and Q of one expert branch (non-persistent: a PEFT adapter of fused experts is lean, B/Q come from the
    bundle)."""

    plate_B_idx: torch.Tensor
    plate_Q: torch.Tensor

    def __init__(self, b_idx: torch.Tensor, q: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("plate_B_idx", b_idx, persistent=False)
        self.register_buffer("plate_Q", q.contiguous(), persistent=False)


class PlateExpertsLayer(nn.Module, BaseTunerLayer):
    """A model's experts module whose fused 3-D parameters carry PLATE branches, per adapter and expert.

    ``plate_A[adapter][key]`` is expert ``key``'s A (key: ``<param>__<expert>__<block>``); the forward runs the
    base experts on each adapted parameter materialized as W + the active adapters' rho B A Q^T (as apply_bundle's
    ``PlateExperts``); merge writes the rows in place and unmerge restores them bit for bit.
    """

    adapter_layer_names = ("plate_A",)
    other_param_names = ("plate_geometry", "plate_slots", "plate_rho")
    plate_experts = True  # experts._fused_parameters: this layer's base_layer holds the fused parameters

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, geometry: dict[str, ExpertGeometry], rho: float
    ) -> None:
        super().__init__()
        BaseTunerLayer.__init__(self)
        self.base_layer = base_layer
        self.plate_A = nn.ModuleDict({})
        self.plate_geometry = nn.ModuleDict({})
        self.plate_slots: dict[str, dict[str, ExpertSlot]] = {}
        self.plate_rho: dict[str, float] = {}
        self._saved_rows: dict[str, dict[str, torch.Tensor]] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, geometry, rho)

    def update_layer(self, adapter_name: str, geometry: dict[str, ExpertGeometry], rho: float) -> None:
        """Add (or replace) one adapter's branches: a zero A [r, k] per expert, B and Q beside the parameter."""
        params, buffers, slots = nn.ParameterDict({}), nn.ModuleDict({}), {}
        for g in geometry.values():
            p = getattr(self.get_base_layer(), g.slot.param)
            key = PlateExperts.key(g.slot)
            b_idx, q = validate_geometry(g.b_idx, g.q, g.slot.d_out, g.slot.d_in, where=g.slot.bundle_name)
            buffers[key] = _ExpertBuffers(b_idx.to(p.device), q.to(p.device, torch.float32))
            params[key] = nn.Parameter(torch.zeros(b_idx.numel(), q.shape[1], device=p.device))
            slots[key] = g.slot
        self.plate_A[adapter_name] = params
        self.plate_geometry[adapter_name] = buffers
        self.plate_slots[adapter_name] = slots
        self.plate_rho[adapter_name] = check_rho(rho)
        self.set_adapter(self.active_adapters)

    def _branches(self, name: str) -> list[tuple[ExpertSlot, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(slot, B, Q, A) of every expert branch of adapter ``name``."""
        out = []
        for key, slot in self.plate_slots[name].items():
            per_adapter = self.plate_geometry[name]
            assert isinstance(per_adapter, nn.ModuleDict)
            buffers = per_adapter[key]
            assert isinstance(buffers, _ExpertBuffers)
            a = self.plate_A[name]
            assert isinstance(a, nn.ParameterDict)
            out.append((slot, buffers.plate_B_idx, buffers.plate_Q, a[key]))
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base experts on W + the active adapters' deltas (merged: in the parameters; disabled: none)."""
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(*args, **kwargs)
        active = [a for a in self.active_adapters if a in self.plate_A]
        if self.merged or not active:
            return self.base_layer(*args, **kwargs)
        groups: dict[str, list[tuple[ExpertSlot, torch.Tensor, torch.Tensor, torch.Tensor, float]]] = {}
        for name in active:
            for slot, b_idx, q, a in self._branches(name):
                groups.setdefault(slot.param, []).append((slot, b_idx, q, a, self.plate_rho[name]))
        base = self.get_base_layer()
        swapped = {param: adapted_parameter_rows(getattr(base, param), rows) for param, rows in groups.items()}
        return torch.func.functional_call(base, swapped, args, kwargs, tie_weights=False, strict=False)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """W[B] += rho A Q^T per expert for each adapter; the replaced rows are kept so unmerge() is exact."""
        base = self.get_base_layer()
        for name in check_adapters_to_merge(self, adapter_names):
            if name not in self.plate_A:
                continue
            saved = {}
            for slot, b_idx, q, a in self._branches(name):
                view = slot.view(getattr(base, slot.param).data)
                saved[PlateExperts.key(slot)] = merge_rows(view, slot.layout, b_idx, a, q, self.plate_rho[name])
                if safe_merge and not torch.isfinite(view).all():
                    raise ValueError(f"NaNs detected in the merged weights; the adapter {name} seems to be broken")
            self._saved_rows[name] = saved
            self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo merge() exactly (last merged first)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        base = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            saved = self._saved_rows.pop(name)
            for slot, b_idx, _, _ in reversed(self._branches(name)):
                unmerge_rows(
                    slot.view(getattr(base, slot.param).data), slot.layout, b_idx, saved[PlateExperts.key(slot)]
                )

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        """False: peft's conversion of an adapter to LoRA is not offered for PLATE layers."""
        return False

    def __repr__(self) -> str:
        return "plate." + super().__repr__()


def _check_carried_geometry(layer: PlateLayer, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Before a state dict is loaded: a carried B/Q in it must be valid and the one the adapter was made with.

    Checked on the saved tensors themselves (in the dtype they were saved in), before they are cast to the model's.
    """
    for name, accepted in layer.plate_carried.items():
        b_key, q_key = f"{prefix}plate_B_idx.{name}", f"{prefix}plate_Q.{name}"
        if b_key not in state_dict and q_key not in state_dict:
            continue
        if name in layer._pending and (b_key not in state_dict or q_key not in state_dict):
            missing = b_key if b_key not in state_dict else q_key
            raise BundleError(f"adapter '{name}': the adapter file lacks '{missing}', part of the B/Q it carries")
        b = state_dict.get(b_key, layer.plate_B_idx[name])
        q = state_dict.get(q_key, layer.plate_Q[name])
        where = f"adapter '{name}', module '{prefix.rstrip('.')}'"
        b, q = validate_geometry(b, q, layer.out_features, layer.in_features, where=where)
        if geometry_digest(b, q) not in accepted:
            raise BundleError(f"{where}: the carried B/Q differ from the ones it was trained with (edited adapter?)")
        layer._pending.discard(name)


def _carried_geometry_loaded(layer: PlateLayer, incompatible: Any) -> None:
    """After a state dict is loaded: every carried B/Q was in it; Q is held in the model's dtype."""
    if layer._pending:
        name = sorted(layer._pending)[0]
        raise BundleError(f"adapter '{name}': the adapter file lacks the B/Q it should carry (incomplete adapter)")
    weight = layer_weight(layer.get_base_layer())
    for name in layer.plate_carried:
        q = layer.plate_Q[name]
        if weight.is_floating_point() and q.dtype != weight.dtype and not q.is_meta:
            layer.plate_Q[name] = q.to(weight.dtype)


def _carried_digests(b_idx: torch.Tensor, q: torch.Tensor) -> dict[str, str]:
    """Digests of B with the bundle's Q rounded to each dtype a model may hold (and save) a carried Q in."""
    return {str(dt).removeprefix("torch."): geometry_digest(b_idx, q.to(dt)) for dt in _CARRY_DTYPES}


_CARRY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _zero_empty_a(model: nn.Module, adapter_name: str) -> None:
    """Give a zero A (PLATE's start) to every branch of ``adapter_name`` that peft made on the meta device beside a
    loaded weight (``low_cpu_mem_usage=True``: the tensors wait for a state dict, and ``get_peft_model`` loads none).

    A meta A is no value: torch's CPU kernels read it as garbage (the logits moved, training stepped nothing). A
    zero A costs r*k numbers; a state dict loaded afterwards (``PeftModel.from_pretrained``, assign=True) replaces
    it. Branches made on meta-device weights keep a meta A until their weights come (``AwaitingWeights``).
    """
    for layer in model.modules():
        if not isinstance(layer, PlateLayer) or adapter_name not in layer.plate_A:
            continue
        a = layer.plate_A[adapter_name]
        base = layer.get_base_layer()
        weight = layer_weight(base)
        # an accelerate-offloaded weight is loaded too (meta between calls): A goes where B/Q went, the hook's device
        device = layer.plate_Q[adapter_name].device if offload_hook(base) is not None else weight.device
        if is_meta_tensor(a) and device.type != "meta" and f"plate_A.{adapter_name}" not in layer._awaiting:
            zero = torch.zeros(a.shape, dtype=a.dtype, device=device)
            layer.plate_A[adapter_name] = nn.Parameter(zero, requires_grad=a.requires_grad)


def _plate_config(config: PeftConfig) -> PlateConfig:
    """A PlateModel's adapter config (peft types ``peft_config`` as holding any PeftConfig; a tuner holds its own)."""
    assert isinstance(config, PlateConfig), f"a PlateModel adapter with a {type(config).__name__}"
    return config


def _tuner_base(module: nn.Module, name: str) -> nn.Module:
    """The layer a PEFT tuner layer wraps (a second adapter checks the base weights); refused while merged."""
    if not isinstance(module, BaseTunerLayer):
        return module
    if module.merged:
        raise ConfigError(
            f"module '{name}': adapters {module.merged_adapters} are merged into its weight; call "
            "unmerge_adapter() before adding or loading another PLATE adapter"
        )
    return module.get_base_layer()


def _finite_number(w: object) -> bool:
    return not isinstance(w, bool) and isinstance(w, numbers.Real) and math.isfinite(w)


def _bundle_digest(records: dict[str, dict[str, Any]]) -> str:
    """One digest over every adapted module's weight fingerprint and B/Q digest."""
    h = hashlib.sha256()
    for n in sorted(records):
        h.update(f"{n}|{records[n]['fingerprint']}|{records[n]['digest']}\n".encode())
    return "sha256:" + h.hexdigest()


_POINT_AT_BUNDLE = (
    "config = PlateConfig.from_pretrained(ADAPTER_DIR); config.bundle = BUNDLE_DIR; "
    "PeftModel.from_pretrained(base, ADAPTER_DIR, config=config)"
)


def _load_recorded_bundle(config: PlateConfig) -> Bundle:
    """The bundle a saved (lean) adapter recorded; a missing one is named with how to point the adapter at it."""
    if not Path(config.bundle).exists():
        rel = f", nor at {config.bundle_relative} from the adapter directory" if _relative_applies(config) else ""
        raise BundleError(
            f"{config.bundle}: the bundle this adapter was made with is not there{rel} (moved or deleted?); point the "
            f"adapter at its new place: {_POINT_AT_BUNDLE}; or rescan the base model into {config.bundle} with the "
            "same settings (B/Q are checked)"
        )
    return Bundle.load(config.bundle)


def _first_difference(recorded: dict[str, dict[str, Any]], records: dict[str, dict[str, Any]]) -> str | None:
    """What differs between the module records an adapter saved and the ones its bundle gives now (one phrase)."""
    for m in sorted(recorded):
        old, new = recorded[m], records.get(m)
        if new is None:
            return f"module '{m}' is not in this bundle"
        if old.get("fingerprint") != new["fingerprint"]:
            return f"module '{m}': the bundle was made for other base weights"
        if (old.get("r"), old.get("k")) != (new["r"], new["k"]):
            had, has = f"r = {old.get('r')}, k = {old.get('k')}", f"r = {new['r']}, k = {new['k']}"
            return f"module '{m}': the adapter has {had}, the bundle {has}"
        if old.get("digest") != new["digest"]:
            return f"module '{m}': B/Q differ at the same r and k (rescanned with other settings, or edited)"
    extra = sorted(set(records) - set(recorded))
    return f"module '{extra[0]}' is in the bundle but not in the adapter" if extra else None


@dataclass(frozen=True)
class BranchGeometry:
    """One adapter's branch on one module, as PlateModel prepares it before the layer is made (or updated)."""

    b_idx: torch.Tensor
    q: torch.Tensor
    digest: str  # of B/Q as the bundle stores them
    carried: frozenset[str] | None = None  # the digests a carried (saved) B/Q may have; None: a lean adapter
    pending: bool = False  # the carried B/Q are placeholders the adapter's state dict fills in
    awaiting: AwaitingWeights | None = None  # made beside a meta-device weight: what it owes once that is loaded


@dataclass(frozen=True)
class _Record:
    """What the weight check needs of a module (a bundle ModuleRecord or one recorded in the adapter config)."""

    name: str  # the bundle's module name
    shape: list[int]
    dtype: str
    fingerprint: str


def _select_targets(
    config: PlateConfig,
    mapping: dict[str, str],
    unresolved: list[str],
    model: nn.Module,
    experts: dict[str, ExpertSlot] | None = None,
) -> tuple[list[str], list[str]]:
    """Model names of the bundle modules ``config.target_modules`` selects; it is then set to exactly those names.

    peft's rules: a list entry matches a whole name or a ``.``-separated suffix, a string is a regular expression
    that must match a whole name; here an entry may name the model's module or the bundle's (checkpoint) one.
    ``unresolved``: bundle modules the model has no layer for; selecting one is refused, unless it is in
    ``experts`` (an expert of a fused 3-D parameter: an entry selects it by its bundle name, or all experts of a
    fused parameter by that parameter's name, as LoRA's ``target_parameters``: ``"mlp.experts.gate_up_proj"``).
    Returns (model names of the chosen layers, bundle names of the chosen experts); ``config.target_modules``
    becomes those, plus the experts modules that hold the chosen experts (where peft's injection places them).
    """
    experts = experts or {}
    tm = config.target_modules
    chosen_experts: list[str] = []
    if tm is None or tm == "all-linear":  # the bundle holds only linear layers
        chosen = list(mapping.values())
        chosen_experts = list(experts)
        if len(experts) < len(unresolved):
            raise unresolved_modules(model, [n for n in unresolved if n not in experts], len(mapping) + len(experts))
    else:
        if isinstance(tm, str):
            pattern = re.compile(tm)

            def match(key: str) -> bool:
                return pattern.fullmatch(key) is not None
        else:

            def match(key: str) -> bool:
                return any(key == t or key.endswith("." + t) for t in tm)

        chosen = [m for n, m in mapping.items() if match(m) or match(n)]
        chosen_experts = [n for n, slot in experts.items() if match(n) or match(f"{slot.owner}.{slot.param}")]
        wanted = [n for n in unresolved if match(n) and n not in experts]
        if wanted:
            raise unresolved_modules(model, wanted, len(mapping) + len(experts))
        fused_names = {f"{slot.owner}.{slot.param}" for slot in experts.values()} | {s.owner for s in experts.values()}
        names = [*mapping, *mapping.values(), *unresolved, *fused_names]
        unused = [] if isinstance(tm, str) else [t for t in tm if not any(k == t or k.endswith("." + t) for k in names)]
        if chosen and unused:
            warnings.warn(
                f"target_modules {sorted(unused)} match no module of the bundle and are ignored (PLATE adapts only "
                "the bundle's modules; other trainable modules go in modules_to_save)",
                stacklevel=4,
            )
    if not chosen and not chosen_experts:
        shown = ", ".join(list(mapping.values())[:3])
        hint = ""
        if isinstance(tm, str) and any(m.endswith("." + tm) for m in mapping.values()):
            hint = f" (to match it as a name suffix, pass a list: target_modules=[{tm!r}])"
        given = tm if isinstance(tm, str) else sorted(tm or ())  # as given, not peft's set ("set()" for [])
        raise BundleError(
            f"target_modules {given!r} match none of the bundle's {len(mapping)} modules ({shown}, ...){hint}; "
            "accepted: a list of module names or name suffixes, the model's or the bundle's (['q_proj', 'v_proj']); "
            "a string, which as in peft is a regular expression matching whole names ('.*\\.q_proj'); "
            "None or 'all-linear' for every module of the bundle"
        )
    config.target_modules = set(chosen) | set(chosen_experts) | {experts[n].owner for n in chosen_experts}
    return chosen, chosen_experts


#: the head names peft adds to modules_to_save for a task (SEQ_CLS / TOKEN_CLS: both; a model has one of them)
_PEFT_HEAD_NAMES = (frozenset({"classifier", "score"}),)


def _other_head_name_reached(name: str, names: list[str], keys: list[str]) -> bool:
    """Whether ``name`` is one of peft's alternative head names and another of them reaches a module: then peft added
    both (the user gave neither), and the one the model lacks is no mistake to warn about."""
    group = next((g for g in _PEFT_HEAD_NAMES if name in g), frozenset())
    return any(other in names and any(k.endswith(other) for k in keys) for other in group - {name})


def _check_modules_to_save(names: list[str] | None, model: nn.Module, chosen: list[str]) -> None:
    """peft's two rules for ``modules_to_save``, side by side: a module named whole (``fc2``, ``...q_proj``) is left
    out of the adapted ones and trained fully, as with LoRA; but peft saves every module whose name merely ends
    with an entry (``'2'`` reaches ``fc2``), and one of those that PLATE adapts made peft fail with a TypeError after
    the adapter was built: a ConfigError now. An entry that reaches no module is warned about (LoRA ignores it
    silently: the head meant to train stays frozen)."""
    keys = [k for k, _ in model.named_modules() if k]

    def named_whole(key: str) -> bool:  # peft's own test (tuners_utils.check_target_module_exists)
        return any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", key) for m in names or ())

    for name in names or ():
        reached = [k for k in keys if k.endswith(name)]
        clash = [k for k in reached if k in chosen and not named_whole(k)]
        if clash:
            whole = [k for k in reached if k not in clash]
            example = whole[0].rsplit(".", 1)[-1] if whole else clash[0].rsplit(".", 1)[-1]
            raise ConfigError(
                f"PlateConfig: modules_to_save entry {name!r} ends the name of {', '.join(clash[:3])}, which PLATE "
                "adapts (peft would save it fully too, and fail); give whole module names, e.g. "
                f"{example!r} (a module of the bundle named whole is trained fully instead of adapted)"
            )
        if not reached and not _other_head_name_reached(name, names or [], keys):
            warnings.warn(
                f"PlateConfig: modules_to_save entry {name!r} matches no module of the model and is ignored (it "
                "trains the modules whose name ends with it)",
                stacklevel=4,
            )


class PlateModel(BaseTuner):
    """The PEFT tuner that replaces a bundle's modules by PlateLayers."""

    prefix: str = "plate_"
    tuner_layer_cls = (PlateLayer, PlateExpertsLayer)  # type: ignore[assignment]  # peft only isinstance()s it
    target_module_mapping: dict[str, list[str]] = {}

    def __getattr__(self, name: str) -> Any:
        """peft's (attributes of the wrapped model), except that the model's checkpointing switch also makes the
        embeddings' output require grad (``layer.require_input_grads``: covers checkpointing switched on after
        ``get_peft_model``, as the Trainer's ``gradient_checkpointing=True`` does)."""
        attr = super().__getattr__(name)
        if name in CHECKPOINTING_ENABLE and callable(attr):
            return CheckpointingWithInputGrads(self.model, attr)
        return attr

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        """Build the bundle's geometry for ``adapter_name`` (unless add_weighted_adapter did), then peft's injection."""
        if adapter_name not in getattr(self, "_combined", ()):  # add_weighted_adapter built its geometry already
            self._prepare_plate(model, adapter_name)
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        _zero_empty_a(model, adapter_name)  # low_cpu_mem_usage; peft's inject_adapter_in_model calls nothing after

    def add_weighted_adapter(
        self, adapters: list[str], weights: list[float], adapter_name: str, combination_type: str = "linear"
    ) -> None:
        """Add ``adapter_name`` whose update is sum_i w_i rho_i B A_i Q^T (LoRA's ``combination_type="linear"``).

        Exact: adapters made from one bundle share B and Q per module, so the sum is one PLATE update with
        A = sum_i (w_i rho_i / rho) A_i (rho: the first adapter's). Adapters with other B/Q on a module (other bundles
        or settings) have no common A; they, and the other combination types, are refused in one line. The new
        adapter is inactive and frozen until ``set_adapter``; it saves and loads like the first adapter.
        """
        where = "add_weighted_adapter"
        if any(isinstance(m, PlateExpertsLayer) for m in self.model.modules()):
            raise ConfigError(
                f"{where}: the adapters adapt experts of fused 3-D parameters, which add_weighted_adapter does not "
                "combine yet; combine them by hand (A = sum_i w_i rho_i A_i / rho per expert) or leave the experts out"
            )
        if combination_type != "linear":
            raise ConfigError(
                f"{where}: combination_type {combination_type!r}: PLATE adapters combine linearly only "
                "(combination_type='linear': exact, A = sum of w_i rho_i A_i / rho over their shared B and Q)"
            )
        adapters = [adapters] if isinstance(adapters, str) else list(adapters)
        weights = list(weights)
        if not adapters or len(weights) != len(adapters):
            counts = f"{len(adapters)} adapters, {len(weights)} weights"
            raise ConfigError(f"{where}: give one weight per adapter ({counts})")
        if not all(_finite_number(w) for w in weights):
            raise ConfigError(f"{where}: weights must be finite numbers, got {weights!r}")
        missing = [a for a in adapters if a not in self.peft_config]
        if missing:
            raise ConfigError(f"{where}: no adapter {missing[0]!r} (the model has {sorted(self.peft_config)})")
        if adapter_name in self.peft_config:
            raise ConfigError(
                f"{where}: an adapter named {adapter_name!r} exists already; pick another name or "
                f"delete_adapter({adapter_name!r}) first"
            )
        configs = [_plate_config(self.peft_config[a]) for a in adapters]
        records: dict[str, dict[str, Any]] = {}
        owner: dict[str, str] = {}
        for a, c in zip(adapters, configs, strict=True):
            for m, rec in (c.module_records or {}).items():
                if m in records and records[m]["digest"] != rec["digest"]:
                    raise ConfigError(
                        f"{where}: adapters {owner[m]!r} and {a!r} have different B/Q on module '{m}' (made from "
                        "other bundles or settings): no single PLATE adapter equals their weighted sum; combine "
                        "adapters of one bundle, or merge them in turn (merge_adapter(adapter_names=[...]))"
                    )
                records.setdefault(m, rec)
                owner.setdefault(m, a)
        if len({c.carry_geometry for c in configs}) > 1:
            raise ConfigError(
                f"{where}: adapters {adapters} mix ones that carry their B/Q with lean ones; combine adapters of one "
                "form (PlateConfig(carry_geometry=...))"
            )
        if not configs[0].carry_geometry and len({c.bundle for c in configs}) > 1:
            raise ConfigError(
                f"{where}: adapters {adapters} read their B/Q from different bundle paths "
                f"({sorted({str(c.bundle) for c in configs})}); a lean adapter reads them from one: combine adapters "
                "made from one bundle"
            )
        geometry: dict[str, BranchGeometry] = {}
        for name, layer in self.model.named_modules():
            held = [a for a in adapters if isinstance(layer, PlateLayer) and a in layer.plate_A]
            if not held:
                continue
            _tuner_base(layer, name)  # refused while adapters are merged into this layer
            if layer._awaiting:
                raise ConfigError(f"{where}: module '{name}' waits for its weights; call finish_meta_init(model) first")
            first = held[0]
            b_idx, q = layer.plate_B_idx[first], layer.plate_Q[first]
            geometry[name] = BranchGeometry(b_idx, q, layer.plate_digest[first], layer.plate_carried.get(first))
        rho = configs[0].rho
        self.peft_config[adapter_name] = replace(
            configs[0], target_modules=set(records), module_records=records, bundle_digest=_bundle_digest(records)
        )
        self._plate[adapter_name] = geometry
        self._combined = {adapter_name}
        try:
            self.inject_adapter(self.model, adapter_name)
        except BaseException:
            self.peft_config.pop(adapter_name, None)
            self._plate.pop(adapter_name, None)
            raise
        finally:
            self._combined = set()
        with torch.no_grad():
            for name in geometry:
                layer = self.model.get_submodule(name)
                total = torch.zeros(layer.plate_A[adapter_name].shape, dtype=torch.float64)
                for a, w in zip(adapters, weights, strict=True):
                    if a in layer.plate_A:
                        total += (float(w) * layer.plate_rho[a] / rho) * layer.plate_A[a].detach().double().cpu()
                layer.plate_A[adapter_name].copy_(total)  # rounded once to A's dtype

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """peft upcasts every bf16/fp16 adapter tensor to float32 (``autocast_adapter_dtype``, on by default): right
        for A, but a carried Q stays in the model's dtype, as ``carry_geometry`` promises (half the adapter's size
        in bf16; the widened values are the same, so the round trip is exact).
        peft calls this after making an adapter, outside its ``low_cpu_mem_usage`` context: where a meta A is given
        its zero start (``_zero_empty_a``)."""
        _zero_empty_a(self.model, adapter_name)
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype)
        for layer in self.model.modules():
            if isinstance(layer, PlateLayer) and adapter_name in layer.plate_carried:
                weight = layer_weight(layer.get_base_layer())
                if weight.is_floating_point() and layer.plate_Q[adapter_name].dtype != weight.dtype:
                    layer.plate_Q[adapter_name] = layer.plate_Q[adapter_name].to(weight.dtype)

    def _prepare_plate(self, model: nn.Module, adapter_name: str) -> None:
        """Load the bundle (or the geometry the adapter carries), check weights and the recorded identity."""
        # filled in on a copy: the caller's PlateConfig stays as given, reusable for another model or bundle
        config = copy.copy(_plate_config(self.peft_config[adapter_name]))
        self.peft_config[adapter_name] = config
        if not hasattr(self, "_plate"):
            self._plate: dict[str, dict[str, BranchGeometry]] = {}
        if not config.check_fingerprints:
            warnings.warn("PlateConfig: fingerprint check skipped", stacklevel=3)
        recorded = config.module_records or {}
        if config.carry_geometry and recorded:  # its own B/Q, whatever the bundle path holds now
            self._plate[adapter_name] = self._carried_geometry(model, config)
            return
        bundle = _load_recorded_bundle(config) if recorded else Bundle.load(config.bundle)
        mapping = resolve_module_names(model, bundle.modules, strict=False)  # bundle name -> model name
        unresolved = [n for n in bundle.modules if n not in mapping]
        slots = resolve_expert_slots(model, unresolved, bundle) if unresolved else {}
        chosen, chosen_experts = _select_targets(config, mapping, unresolved, model, slots)
        _check_modules_to_save(config.modules_to_save, model, chosen)
        if chosen_experts and config.carry_geometry:
            raise ConfigError(
                f"PlateConfig(carry_geometry=True): the adapter selects experts of fused 3-D parameters (e.g. "
                f"'{chosen_experts[0]}'), whose adapters are lean only so far; use carry_geometry=False (B/Q are read "
                "from the bundle at load) or leave the experts out (target_modules)"
            )
        inverse = {v: k for k, v in mapping.items()}
        ks = load_plan(config.plan, bundle)
        geometry, records = {}, {}
        for m in chosen:
            name = inverse[m]
            rec = bundle.record(name)
            ref = recorded.get(m, {}).get("sketch")
            ref = WeightSketch.from_json(ref) if ref else None
            module = _tuner_base(model.get_submodule(m), m)
            with onloaded(module):  # an accelerate-offloaded weight, brought in for the check
                refuse_offloaded(module, m, model)
                meta = is_meta_tensor(layer_weight(module))  # checked once loaded (AwaitingWeights)
                sketch = check_module_against_record(
                    module, m, rec, config.check_fingerprints and not meta, ref, bundle, adapter=bool(recorded)
                )
            b_idx, q = module_geometry(bundle, name, ks.get(name), q_dtype=None)  # as stored: the bundle's digest
            digest = geometry_digest(b_idx, q)
            carried = _carried_digests(b_idx, q) if config.carry_geometry else None
            awaiting = None
            if meta:
                check = config.check_fingerprints
                awaiting = AwaitingWeights(m, rec, check, ref, bundle, name, ks.get(name), digest, bool(recorded))
            accepted = frozenset(carried.values()) if carried else None
            geometry[m] = BranchGeometry(b_idx, q, digest, accepted, awaiting=awaiting)
            records[m] = {
                "bundle_module": name,
                "shape": list(rec.shape),
                "dtype": rec.dtype,
                "fingerprint": rec.fingerprint,
                "digest": digest,
                "r": int(b_idx.numel()),
                "k": int(q.shape[1]),
                "sketch": sketch.to_json() if sketch is not None else recorded.get(m, {}).get("sketch"),
            }
            if carried:
                records[m]["carried_digests"] = carried
            if awaiting is not None:
                awaiting.record_entry = records[m]  # its weight sketch is filled in once the weight is checked
        expert_geometry: dict[str, dict[str, ExpertGeometry]] = {}  # experts module name -> {bundle module: ...}
        for name in chosen_experts:
            rec = bundle.record(name)
            ref = recorded.get(name, {}).get("sketch")
            ref = WeightSketch.from_json(ref) if ref else None
            slot = slots[name]
            owner = model.get_submodule(slot.owner)
            base = owner.get_base_layer() if isinstance(owner, BaseTunerLayer) else owner
            if isinstance(owner, PlateExpertsLayer) and owner.merged:
                raise BundleError(f"module '{slot.owner}': adapters are merged into it; unmerge_adapter() first")
            slot, sketch = check_expert_against_record(
                slot, getattr(base, slot.param), rec, config.check_fingerprints, ref, bundle, adapter=bool(recorded)
            )
            b_idx, q = module_geometry(bundle, name, ks.get(name), q_dtype=None)
            digest = geometry_digest(b_idx, q)
            expert_geometry.setdefault(slot.owner, {})[name] = ExpertGeometry(slot, b_idx, q, digest)
            records[name] = {
                "bundle_module": name,
                "expert_of": f"{slot.owner}.{slot.param}",
                "shape": list(rec.shape),
                "dtype": rec.dtype,
                "fingerprint": rec.fingerprint,
                "digest": digest,
                "r": int(b_idx.numel()),
                "k": int(q.shape[1]),
                "sketch": sketch.to_json() if sketch is not None else recorded.get(name, {}).get("sketch"),
            }
        if not hasattr(self, "_plate_experts"):
            self._plate_experts: dict[str, dict[str, dict[str, ExpertGeometry]]] = {}
        self._plate_experts[adapter_name] = expert_geometry
        digest = _bundle_digest(records)
        sig = bundle.manifest.source_signature
        if config.bundle_digest is not None and config.bundle_digest != digest:
            differs = _first_difference(recorded, records) or "its modules' digest differs"
            raise BundleError(
                f"{config.bundle}: this adapter was trained with another bundle ({differs}); load it with the bundle "
                f"it was made for ({_POINT_AT_BUNDLE}), or save adapters with PlateConfig(carry_geometry=True)"
            )
        if config.bundle_signature is not None and config.bundle_signature != sig:
            raise BundleError(f"{config.bundle}: bundle source signature differs from the one the adapter recorded")
        config.bundle_digest, config.bundle_signature, config.module_records = digest, sig, records
        self._plate[adapter_name] = geometry

    def _carried_geometry(self, model: nn.Module, config: PlateConfig) -> dict[str, BranchGeometry]:
        """Placeholders of the recorded shapes for an adapter that carries B and Q (its state dict fills them in)."""
        records = config.module_records or {}
        if _bundle_digest(records) != config.bundle_digest:
            raise BundleError(f"{config.bundle}: the adapter's module records do not match its bundle digest")
        config.target_modules = set(records)
        geometry: dict[str, BranchGeometry] = {}
        for m, rec in records.items():
            try:
                module = model.get_submodule(m)
            except AttributeError:
                raise BundleError(
                    f"adapter module '{m}': the model has no such module; it belongs to another model"
                ) from None
            module = _tuner_base(module, m)
            with onloaded(module):
                refuse_offloaded(module, m, model)
                if is_meta_tensor(layer_weight(module)):
                    raise BundleError(
                        f"adapter module '{m}': the model's weights are on the meta device; an adapter that carries "
                        "its B/Q loads onto loaded weights: load them first (from_pretrained, or to_empty() + "
                        "load_state_dict)"
                    )
                sketch = WeightSketch.from_json(rec["sketch"]) if rec.get("sketch") else None
                check_module_against_record(
                    module,
                    m,
                    _Record(rec.get("bundle_module", m), rec["shape"], rec["dtype"], rec["fingerprint"]),
                    config.check_fingerprints,
                    sketch,
                    adapter=True,
                )
            # adapters written before carried_digests recorded one digest, of Q in the dtype it was saved in
            accepted = frozenset((rec.get("carried_digests") or {}).values()) or frozenset([rec.get("carried_digest")])
            if None in accepted:
                raise BundleError(f"adapter module '{m}': adapter_config.json records no digest of the carried B/Q")
            q = torch.zeros(rec["shape"][1], rec["k"])
            geometry[m] = BranchGeometry(torch.arange(rec["r"]), q, rec["digest"], accepted, pending=True)
        return geometry

    def _create_and_replace(
        self,
        peft_config: PeftConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        parameter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        experts = getattr(self, "_plate_experts", {}).get(adapter_name, {})
        if current_key in experts:
            rho = _plate_config(peft_config).rho
            if isinstance(target, PlateExpertsLayer):
                target.update_layer(adapter_name, experts[current_key], rho)
            else:
                new_experts = PlateExpertsLayer(target, adapter_name, experts[current_key], rho)
                if adapter_name not in self.active_adapters:
                    new_experts.requires_grad_(False)
                self._replace_module(parent, target_name, new_experts, target)
            return
        geometry = self._plate[adapter_name]
        if current_key not in geometry:
            raise BundleError(f"module '{current_key}' matches target_modules but the bundle has no geometry for it")
        rho = _plate_config(peft_config).rho
        # an accelerate-offloaded weight is brought in meanwhile: B, Q and A go where its hook runs the layer
        with onloaded(target.get_base_layer() if isinstance(target, PlateLayer) else target):
            if isinstance(target, PlateLayer):
                target.update_layer(adapter_name, geometry[current_key], rho)
            else:
                new_module = PlateLayer(target, adapter_name, geometry[current_key], rho)
                new_module.module_name = current_key  # named in its errors
                if adapter_name not in self.active_adapters:
                    new_module.requires_grad_(False)
                self._replace_module(parent, target_name, new_module, target)

    def _replace_module(self, parent: nn.Module, child_name: str, new_module: nn.Module, child: nn.Module) -> None:
        """peft's, except that B/Q made beside a meta-device weight keep their real values (peft moves every adapter
        submodule without parameters to the weight's device: meta, where the values would be lost)."""
        if isinstance(child, PlateExpertsLayer) and new_module is child.get_base_layer():  # unloaded experts: peft's
            setattr(parent, child_name, new_module)  # would copy a '.weight' that an experts module does not have
            return
        real = {n: b for n, b in new_module.named_buffers() if n.startswith(self.prefix) and not b.is_meta}
        super()._replace_module(parent, child_name, new_module, child)
        for name, buffer in real.items():
            owner, _, leaf = name.rpartition(".")
            module = new_module.get_submodule(owner)
            now = module._buffers[leaf]
            if now is not None and now.is_meta:
                module._buffers[leaf] = buffer

    def _prepare_adapter_config(self, peft_config: PeftConfig, model_config: dict) -> PeftConfig:
        return peft_config


def _register() -> None:
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    if PEFT_TYPE_TO_TUNER_MAPPING.get(PLATE_TYPE) is PlateModel:
        return
    register_peft_method(name=PEFT_NAME, config_cls=PlateConfig, model_cls=PlateModel, prefix="plate_")


_register()
