"""PLATE on fused MoE experts: expert e's weight W_e' = W_e + rho B_e A_e Q_e^T inside a 3-D parameter.

transformers 5 holds every MoE model's experts as 3-D parameters (Qwen3-MoE: ``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]; gpt-oss: [E, d_in, d_out]), while a bundle has one module per
expert and projection: the checkpoint's names (``mlp.experts.3.gate_proj``, Mixtral's ``block_sparse_moe.experts.3.w1``)
or, for 3-D tensors on disk, ``<tensor>.<e>``. ``resolve_expert_slots`` maps each such bundle module to its block of
a fused parameter with transformers' own conversion mapping (the renamings and the ``MergeModulelist`` /
``Concatenate`` converters that build the fused parameter at load time): which parameter, which expert, which
block of rows (gate is block 0 of gate_up, up block 1) and the orientation ([E, d_out, d_in] or [E, d_in, d_out]),
decided by shapes and confirmed by the bundle's fingerprint of that block (``check_expert_against_record``).

``PlateExperts`` replaces the experts module; it runs the model's own expert forward with each adapted parameter
replaced by W + the deltas of its adapted experts (``torch.func.functional_call``): the adapted parameter is
materialized once per forward, as peft's LoRA ``target_parameters`` does. Each expert's A ([r, k]) is its own
``ExpertBranch`` parameter; merge writes the r rows in place (float32, rounded once) and unmerge restores them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plate_inspect.errors import BundleError
from plate_inspect.train.core import check_rho, geometry_digest, merge_rows, unmerge_rows, validate_geometry
from plate_inspect.train.weightcheck import WeightSketch, check_weight_tensor

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle, ModuleRecord

EXPERT_LAYOUTS = ("experts_out_major", "experts_in_major")


@dataclass(frozen=True)
class ExpertSlot:
    """Where one bundle module lives in a model's fused experts: block ``block`` of ``blocks`` (gate_up's gate is
    0 of 2) of expert ``expert``'s matrix in 3-D parameter ``param`` of module ``owner``.

    ``in_major``: the model holds that parameter as [E, d_in, d_out] (gpt-oss; forward ``x @ W[e]``), else
    [E, d_out, d_in] (``linear(x, W[e])``). ``orientations``: the ones the shapes allow, preferred first (the
    fingerprint check picks the one whose bytes are the bundle's).
    """

    bundle_name: str
    owner: str
    param: str
    expert: int
    block: int
    blocks: int
    d_out: int
    d_in: int
    in_major: bool
    orientations: tuple[bool, ...] = ()

    @property
    def offset(self) -> int:
        """First row (column, for in_major) of this block in the expert's matrix."""
        return self.block * self.d_out

    @property
    def layout(self) -> str:
        """The 2-D view's layout for core.merge_rows: ``linear`` ([d_out, d_in]) or ``conv1d`` ([d_in, d_out])."""
        return "conv1d" if self.in_major else "linear"

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """This slot's 2-D view of the 3-D parameter, in its layout (writes go into ``p``)."""
        lo, hi = self.offset, self.offset + self.d_out
        return p[self.expert, :, lo:hi] if self.in_major else p[self.expert, lo:hi, :]

    def oriented(self, p: torch.Tensor) -> torch.Tensor:
        """This slot's weight as [d_out, d_in]."""
        v = self.view(p)
        return v.t() if self.in_major else v


# --------------------------------------------------------------------------- bundle names -> fused parameters
def _fused_parameters(model: nn.Module) -> dict[str, tuple[str, str, torch.Tensor]]:
    """{model parameter name as the checkpoint's converters name it: (owner module name, attribute, tensor)} for
    every 3-D parameter; a PlateExperts' base is named as the module it replaced."""
    out = {}
    for mod_name, mod in model.named_modules():
        owner = mod_name
        parent, _, leaf = mod_name.rpartition(".")
        wrapper = model.get_submodule(parent) if parent else model
        if (leaf == "base" and isinstance(wrapper, PlateExperts)) or (
            leaf == "base_layer" and getattr(wrapper, "plate_experts", False)  # the PEFT method's experts layer
        ):
            owner = parent
        for attr, p in mod.named_parameters(recurse=False):
            if p.ndim == 3:
                out[f"{owner}.{attr}" if owner else attr] = (owner, attr, p)
    return out


def transformers_conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' (renamings, converters) for this model (its checkpoint conversion mapping), or empty lists for
    a model that is no transformers model (transformers is then not imported here)."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, tf.PreTrainedModel):
        return [], []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def _expert_index(key: str) -> int | None:
    """The expert index in a per-expert checkpoint key: the number after ``experts.`` (else the last number)."""
    m = re.search(r"(?:^|\.)experts\.(\d+)\.", key)
    if m:
        return int(m.group(1))
    numbers = re.findall(r"\.(\d+)\.", key)
    return int(numbers[-1]) if len(numbers) > 1 else None


def _find_param(params: dict[str, Any], key: str) -> str | None:
    """The fused parameter named ``key`` (exactly, or the unique one it is a dotted suffix of / that ends with it)."""
    if key in params:
        return key
    cands = [n for n in params if n.endswith("." + key)] or [n for n in params if key.endswith("." + n)]
    return cands[0] if len(cands) == 1 else None


def _block_of(converter: Any, pattern: str) -> tuple[int, int] | None:
    """(block, blocks) of a per-expert source in a converter that stacks experts (``MergeModulelist(dim=0)``) and
    optionally concatenates the sources along the output rows (``Concatenate(dim=1)``: gate, up); None for any
    other conversion (transposes, interleaves, chunks: not mapped)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return None
    sources = list(converter.source_patterns)
    if len(ops) == 1 and len(sources) == 1:
        return 0, 1
    if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1 and pattern in sources:
        return sources.index(pattern), len(sources)
    return None


def resolve_expert_slots(model: nn.Module, names: list[str], bundle: Bundle) -> dict[str, ExpertSlot]:
    """{bundle module: its slot} for the bundle modules that are experts inside the model's fused 3-D parameters;
    names that are not (or whose conversion is not one this maps) are left out, for the caller to refuse."""
    params = _fused_parameters(model)
    if not params:
        return {}
    renamings, converters = transformers_conversions(model)
    transforms = bool(renamings or converters)
    if transforms:
        from transformers.core_model_loading import rename_source_key
    out = {}
    for name in names:
        record = bundle.record(name)
        d_out, d_in = record.shape
        if record.layout in EXPERT_LAYOUTS:  # 3-D on disk: module '<tensor>.<e>', tensor '<module>' or '.weight'
            stem, _, e = name.rpartition(".")
            if not e.isdigit():
                continue
            expert, keys, stored_in_major = int(e), [stem, stem + ".weight"], record.layout == "experts_in_major"
        elif record.layout == "linear":
            found = _expert_index(name)
            if found is None:
                continue
            expert, keys, stored_in_major = found, [name + ".weight"], False
        else:
            continue
        for key in keys:
            target, pattern = rename_source_key(key, renamings, converters) if transforms else (key, None)
            block: tuple[int, int] | None = (0, 1)
            if pattern is not None:  # a converter builds the fused parameter from this key
                conv = next(c for c in converters if pattern in c.source_patterns)
                block = _block_of(conv, pattern) if record.layout == "linear" else None
            elif record.layout == "linear":  # a per-expert weight no converter stacks: not a fused expert
                block = None
            pname = None if block is None else _find_param(params, target)
            if block is None or pname is None:
                continue
            owner, attr, p = params[pname]
            if not 0 <= expert < p.shape[0]:
                continue
            blocks = block[1]
            fits = {
                False: tuple(p.shape[1:]) == (blocks * d_out, d_in),
                True: tuple(p.shape[1:]) == (d_in, blocks * d_out),
            }
            orientations = tuple(o for o in (stored_in_major, not stored_in_major) if fits[o])
            if orientations:
                out[name] = ExpertSlot(
                    name, owner, attr, expert, block[0], blocks, d_out, d_in, orientations[0], orientations
                )
                break
    return out


def stored_view(slot: ExpertSlot, p: torch.Tensor, record: ModuleRecord) -> tuple[torch.Tensor, str]:
    """(the slot's weight as the checkpoint stores it, that tensor's layout for the weight check): a per-expert
    tensor and an out-major stack store [d_out, d_in]; an in-major stack [d_in, d_out]."""
    w = slot.oriented(p.detach())
    if record.layout == "experts_in_major":
        return w.t(), "conv1d"
    return w, "linear"


def check_expert_against_record(
    slot: ExpertSlot,
    p: torch.Tensor,
    record: ModuleRecord,
    check_fingerprint: bool = True,
    reference: WeightSketch | None = None,
    bundle: Bundle | None = None,
    adapter: bool = False,
) -> tuple[ExpertSlot, WeightSketch | None]:
    """The slot in the orientation whose bytes are the bundle's, and its reference sketch (None unchecked).

    Shapes allowed ``slot.orientations``; the fingerprint decides among them (a square block can fit both ways).
    A weight that is none of them (another model, a fine-tune) is refused as for a Linear layer.
    """
    where = f"{slot.bundle_name} (expert {slot.expert} of {slot.owner}.{slot.param})"  # named as module '...'

    if not p.is_floating_point():
        raise BundleError(
            f"module '{where}': the fused parameter holds {p.dtype} codes (quantized); load the model unquantized"
        )
    if p.is_meta:
        raise BundleError(f"module '{where}': the fused parameter is on the meta device; load the weights first")
    if not check_fingerprint:
        return slot, None
    first_error: BundleError | None = None
    for in_major in slot.orientations:
        candidate = replace(slot, in_major=in_major)
        w, layout = stored_view(candidate, p, record)
        try:
            sketch = check_weight_tensor(w, where, record, layout, reference=reference, bundle=bundle, adapter=adapter)
        except BundleError as e:
            first_error = first_error or e
            continue
        return candidate, sketch
    assert first_error is not None
    raise first_error


# --------------------------------------------------------------------------- the branch and the wrapper
class ExpertBranch(nn.Module):
    """One expert's PLATE branch in a fused parameter: A [r, k] trainable, B (rows of the block) and Q buffers.

    Carries what ``save_adapter`` records for a PlateLinear (bundle name, fingerprint, digest, rho, k, q_dtype,
    weight sketch), so adapters hold expert A's under their bundle names as for any module.
    """

    plate_B_idx: torch.Tensor
    plate_Q: torch.Tensor

    def __init__(
        self, slot: ExpertSlot, b_idx: torch.Tensor, q: torch.Tensor, rho: float, device: torch.device
    ) -> None:
        super().__init__()
        b_idx, q = validate_geometry(b_idx, q, slot.d_out, slot.d_in, where=slot.bundle_name)
        self.slot = slot
        self.rho = check_rho(rho)
        self.geometry_digest = geometry_digest(b_idx, q)
        self.register_buffer("plate_B_idx", b_idx.to(device))
        self.register_buffer("plate_Q", q.to(device).contiguous())
        self.plate_A = nn.Parameter(torch.zeros(b_idx.numel(), q.shape[1], device=device, dtype=torch.float32))
        self._saved_rows: torch.Tensor | None = None
        self._awaiting: dict[str, Any] = {}  # load_adapter's bookkeeping for meta-made layers: never set here
        self.bundle_name = slot.bundle_name
        self.bundle_record_fingerprint = ""
        self.bundle_identity: dict[str, Any] = {}
        self.q_dtype: str | None = "float32"
        self.weight_sketch: WeightSketch | None = None

    @property
    def merged(self) -> bool:
        """Whether rho A Q^T is written into the fused parameter."""
        return self._saved_rows is not None

    @property
    def k(self) -> int:
        """Q's width (A is r x k)."""
        return int(self.plate_Q.shape[1])

    @property
    def r(self) -> int:
        """B's length."""
        return int(self.plate_B_idx.numel())

    def delta_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """rho A Q^T ([r, d_in]) in ``dtype``, differentiable in A."""
        return self.rho * (self.plate_A.to(dtype) @ self.plate_Q.to(dtype).t())

    def extra_repr(self) -> str:
        """Which expert and block, and r, k, rho."""
        s = self.slot
        return (
            f"{s.param}[{s.expert}] block {s.block}/{s.blocks}, d_out={s.d_out}, d_in={s.d_in}, r={self.r}, "
            f"k={self.k}, rho={self.rho}, {'in_major' if s.in_major else 'out_major'}"
        )


def adapted_parameter(p: torch.Tensor, branches: list[ExpertBranch]) -> torch.Tensor:
    """W + every branch's rho B A Q^T, out of place (one copy of the 3-D parameter; gradients reach the A's)."""
    return adapted_parameter_rows(p, [(b.slot, b.plate_B_idx, b.plate_Q, b.plate_A, b.rho) for b in branches])


def adapted_parameter_rows(
    p: torch.Tensor, branches: list[tuple[ExpertSlot, torch.Tensor, torch.Tensor, torch.Tensor, float]]
) -> torch.Tensor:
    """W + rho B A Q^T for each (slot, B, Q, A, rho), computed in float32 or wider and added in W's dtype."""
    dt = torch.promote_types(p.dtype, torch.float32)
    values = torch.cat([rho * (a.to(dt) @ q.to(dt).t()) for _, _, q, a, rho in branches]).to(p.dtype)
    experts = torch.cat([torch.full_like(b, slot.expert) for slot, b, _, _, _ in branches]).to(p.device)
    rows = torch.cat([b + slot.offset for slot, b, _, _, _ in branches]).to(p.device)
    # one flat index_add over the parameter's elements: index_put(accumulate=True) cost ~60x more on CPU (16 ms
    # against 0.26 ms for an [8, 1024, 256] parameter, forward and backward); index_add also sums the deltas of
    # several active adapters on the same rows
    d_mid, d_last = p.shape[1], p.shape[2]
    cols = torch.arange(values.shape[1], device=p.device)
    if branches[0][0].in_major:  # p[e, :, row] += value: element (e, i, row)
        flat = (experts[:, None] * d_mid + cols[None, :]) * d_last + rows[:, None]
    else:  # p[e, row, :] += value: element (e, row, i)
        flat = (experts[:, None] * d_mid + rows[:, None]) * d_last + cols[None, :]
    return p.reshape(-1).index_add(0, flat.reshape(-1), values.reshape(-1)).view(p.shape)


class PlateExperts(nn.Module):
    """A model's experts module with PLATE branches on experts of its fused 3-D parameters.

    Forward: the base module's own forward with each adapted parameter replaced by ``adapted_parameter``
    (materialized per call; merged branches are in the parameter already). Attributes the model reads on its
    experts module (``num_experts``, ...) come from the base.
    """

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.branches = nn.ModuleDict()
        for p in base.parameters():
            p.requires_grad_(False)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    @staticmethod
    def key(slot: ExpertSlot) -> str:
        """The branch's key in ``branches`` (ModuleDict keys cannot hold dots)."""
        return f"{slot.param}__{slot.expert}__{slot.block}"

    def add(self, branch: ExpertBranch) -> None:
        """Add one expert's branch; a second branch for the same block is refused."""
        key = self.key(branch.slot)
        if key in self.branches:
            raise BundleError(
                f"module '{branch.bundle_name}': expert {branch.slot.expert} of {branch.slot.param} is already "
                "adapted; merge or unload it first"
            )
        self.branches[key] = branch

    def by_param(self, unmerged: bool = False) -> dict[str, list[ExpertBranch]]:
        """Branches grouped by the parameter they adapt (only the unmerged ones with ``unmerged``)."""
        out: dict[str, list[ExpertBranch]] = {}
        for b in self.branches.values():
            assert isinstance(b, ExpertBranch)
            if not (unmerged and b.merged):
                out.setdefault(b.slot.param, []).append(b)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base experts' forward on W + the unmerged branches' deltas."""
        groups = self.by_param(unmerged=True)
        if not groups:
            return self.base(*args, **kwargs)
        swapped = {name: adapted_parameter(getattr(self.base, name), bs) for name, bs in groups.items()}
        return torch.func.functional_call(self.base, swapped, args, kwargs, tie_weights=False, strict=False)

    def merge(self) -> None:
        """Write every branch into its parameter (rows kept for an exact unmerge)."""
        for b in self.branches.values():
            assert isinstance(b, ExpertBranch)
            if not b.merged:
                view = b.slot.view(getattr(self.base, b.slot.param).data)
                b._saved_rows = merge_rows(view, b.slot.layout, b.plate_B_idx, b.plate_A, b.plate_Q, b.rho)

    def unmerge(self) -> None:
        """Restore the parameters bit for bit."""
        for b in self.branches.values():
            assert isinstance(b, ExpertBranch)
            if b._saved_rows is not None:
                unmerge_rows(
                    b.slot.view(getattr(self.base, b.slot.param).data), b.slot.layout, b.plate_B_idx, b._saved_rows
                )
                b._saved_rows = None


def plate_experts(model: nn.Module) -> dict[str, PlateExperts]:
    """The model's PlateExperts modules by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PlateExperts)}


def expert_branches(model: nn.Module) -> dict[str, ExpertBranch]:
    """Every expert branch by bundle module name."""
    return {
        b.bundle_name: b
        for m in plate_experts(model).values()
        for b in m.branches.values()
        if isinstance(b, ExpertBranch)
    }
