"""The PLATE layer: a frozen linear map plus rho * B A Q^T, with only A trainable.

``PlateLinear`` wraps an ``nn.Linear`` (weight [d_out, d_in]) or a GPT-2 ``Conv1D`` (weight stored [d_in, d_out]).
Forward: ``y = base(x) + rho * index_add over B of ((x Q) A^T)``: B is an int64 index buffer (never a dense
d_out x r matrix), Q a frozen [d_in, k] buffer, A a zero-initialised [r, k] parameter. ``merge()`` writes
``W[B] += rho A Q^T`` into the base weight and keeps the original rows, so ``unmerge()`` restores them bit for bit.

``apply_bundle(model, bundle)`` checks the bundle against the model's weights (fingerprints), wraps every bundle
module, freezes everything else and returns the trainable A's. ``save_adapter``/``load_adapter`` store the A's as
safetensors together with the bundle's identity, and refuse an adapter made for another bundle or other weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plate_inspect.bundle import Bundle
from plate_inspect.checkpoint import fingerprint_tensor
from plate_inspect.dtypes import FLOAT_DTYPES
from plate_inspect.errors import BundleError, ConfigError

ADAPTER_FORMAT = "plate-adapter"
ADAPTER_VERSION = 1


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
    a, b = module.weight.shape
    return (b, a) if layout_of(module) == "conv1d" else (a, b)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the adapter branch runs in: the autocast dtype when autocast is on, else the input's dtype."""
    dev = x.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except TypeError:  # torch < 2.4: no device argument
        if dev == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if dev == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
    return x.dtype


def plate_delta(x: torch.Tensor, q: torch.Tensor, a: torch.Tensor, rho: float) -> torch.Tensor:
    """rho * (x Q) A^T, shape [..., r], computed in the input's (or autocast's) dtype."""
    dt = compute_dtype(x)
    z = torch.matmul(x.to(dt), q.to(dt))
    return torch.matmul(z, a.to(dt).t()) * rho


def scatter_add_rows(y: torch.Tensor, b_idx: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """y with delta added into the output features b_idx (out of place, differentiable)."""
    return y.index_add(-1, b_idx, delta.to(y.dtype))


def delta_rows(a: torch.Tensor, q: torch.Tensor, rho: float) -> torch.Tensor:
    """rho A Q^T in float32 or wider: the change of the r selected rows of W ([r, d_in])."""
    dt = torch.promote_types(torch.promote_types(a.dtype, q.dtype), torch.float32)
    return rho * (a.detach().to(dt) @ q.detach().to(dt).t())


class PlateLinear(nn.Module):
    """A frozen Linear/Conv1D plus a PLATE branch: y = base(x) + rho * scatter_B((x Q) A^T)."""

    def __init__(self, base: nn.Module, b_idx: torch.Tensor, q: torch.Tensor, rho: float = 0.5):
        super().__init__()
        self.layout = layout_of(base)
        d_out, d_in = oriented_shape(base)
        b_idx = torch.as_tensor(b_idx, dtype=torch.int64).flatten()
        if q.ndim != 2 or q.shape[0] != d_in:
            raise BundleError(f"Q has shape {list(q.shape)} but the layer has d_in={d_in}")
        if b_idx.numel() and (int(b_idx.min()) < 0 or int(b_idx.max()) >= d_out):
            raise BundleError(f"B indexes rows outside 0..{d_out - 1}")
        if torch.unique(b_idx).numel() != b_idx.numel():
            raise BundleError("B has repeated rows")
        self.base = base
        self.rho = float(rho)
        self.d_out, self.d_in = d_out, d_in
        dev = base.weight.device
        self.register_buffer("plate_B_idx", b_idx.to(dev))
        self.register_buffer("plate_Q", q.detach().to(dev).contiguous())
        self.plate_A = nn.Parameter(torch.zeros(b_idx.numel(), q.shape[1], device=dev, dtype=torch.float32))
        self.register_buffer("_saved_rows", None, persistent=False)
        self.merged = False
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def r(self) -> int:
        return int(self.plate_B_idx.numel())

    @property
    def k(self) -> int:
        return int(self.plate_Q.shape[1])

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged or self.r == 0:
            return y
        return scatter_add_rows(y, self.plate_B_idx, plate_delta(x, self.plate_Q, self.plate_A, self.rho))

    def delta_weight(self) -> torch.Tensor:
        """The dense update rho B A Q^T as [d_out, d_in] float32 (for checks and small layers only)."""
        d = delta_rows(self.plate_A, self.plate_Q, self.rho)
        full = torch.zeros(self.d_out, self.d_in, dtype=d.dtype, device=d.device)
        full[self.plate_B_idx] = d
        return full

    @torch.no_grad()
    def merge(self) -> None:
        """W[B] += rho A Q^T in the base weight (computed in float32, rounded once to the weight's dtype)."""
        if self.merged:
            return
        w = self.base.weight
        d = delta_rows(self.plate_A, self.plate_Q, self.rho)
        if self.layout == "linear":
            rows = w[self.plate_B_idx]
            self._saved_rows = rows.clone()
            w[self.plate_B_idx] = (rows.to(d.dtype) + d).to(w.dtype)
        else:
            cols = w[:, self.plate_B_idx]
            self._saved_rows = cols.clone()
            w[:, self.plate_B_idx] = (cols.to(d.dtype) + d.t()).to(w.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the base weight exactly as it was before merge()."""
        if not self.merged:
            return
        w = self.base.weight
        if self.layout == "linear":
            w[self.plate_B_idx] = self._saved_rows
        else:
            w[:, self.plate_B_idx] = self._saved_rows
        self._saved_rows = None
        self.merged = False

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, r={self.r}, k={self.k}, rho={self.rho}, layout={self.layout}"


# --------------------------------------------------------------------------- bundle -> model
def plate_digest(b_idx: torch.Tensor, q: torch.Tensor) -> str:
    """Identity of one module's geometry: sha256 over B's indices and Q's bytes."""
    h = hashlib.sha256()
    h.update(b_idx.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    qc = q.detach().to("cpu").contiguous()
    h.update(str(qc.dtype).encode() + str(list(qc.shape)).encode())
    h.update(qc.view(torch.uint8).numpy().tobytes() if qc.numel() else b"")
    return "sha256:" + h.hexdigest()


def resolve_module_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """Bundle (checkpoint) module names -> the model's module names.

    Exact match first; otherwise a unique module whose name ends with ``.<name>`` (model wraps the checkpoint's
    base model, e.g. ``transformer.h.0.attn.c_attn`` for ``h.0.attn.c_attn``) or the unique one that ``<name>``
    ends with (checkpoint carries a prefix the model lacks, e.g. ``model.layers.0...`` into a bare ``Qwen2Model``).
    """
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for name in names:
        if name in modules:
            out[name] = name
            continue
        cands = [m for m in modules if m.endswith("." + name)] or [m for m in modules if m and name.endswith("." + m)]
        if len(cands) != 1:
            why = "no module" if not cands else f"{len(cands)} modules ({', '.join(cands[:3])}...)"
            raise BundleError(f"bundle module '{name}': {why} of the model matches this name")
        out[name] = cands[0]
    return out


def weight_fingerprint(module: nn.Module, stored_dtype: str) -> str:
    """Fingerprint of a module's weight in the checkpoint's stored dtype (an upcast model still matches)."""
    w = module.weight.detach()
    dt = FLOAT_DTYPES.get(stored_dtype)
    if dt is not None and w.dtype != dt:
        w = w.to(dt)
    return fingerprint_tensor(w)


def check_module_against_record(module: nn.Module, name: str, record: Any, check_fingerprint: bool = True) -> None:
    """Refuse a module whose layout, shape or weight bytes differ from what the bundle was made for."""
    layout = layout_of(module)
    shape = list(oriented_shape(module))
    if shape != list(record.shape):
        raise BundleError(
            f"module '{name}': the bundle was made for [d_out, d_in] = {list(record.shape)} but the model's "
            f"{layout} weight is {shape}; this bundle belongs to another model"
        )
    if check_fingerprint and weight_fingerprint(module, record.dtype) != record.fingerprint:
        raise BundleError(
            f"module '{name}': weight fingerprint differs from the bundle's ({record.fingerprint[:19]}...): the "
            "bundle was made for other weights; rescan this checkpoint (plate-inspect scan) or load the right one"
        )


def _as_bundle(bundle: Bundle | str | os.PathLike) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def apply_bundle(
    model: nn.Module,
    bundle: Bundle | str | os.PathLike,
    rho: float = 0.5,
    modules: list[str] | None = None,
    check_fingerprints: bool = True,
    q_dtype: torch.dtype | None = torch.float32,
) -> list[nn.Parameter]:
    """Wrap every bundle module (or the ``modules`` subset) in a PlateLinear; freeze the rest; return the A's.

    Before wrapping, each module's weight fingerprint must equal the manifest's (a mismatch raises BundleError
    naming the module); ``check_fingerprints=False`` skips that check, with a warning. Nothing is wrapped unless
    every module passes.
    """
    b = _as_bundle(bundle)
    names = list(modules) if modules is not None else b.modules
    missing = [n for n in names if n not in b]
    if missing:
        raise BundleError(f"{b.path}: no module '{missing[0]}' in this bundle (it has {', '.join(b.modules[:5])}...)")
    mapping = resolve_module_names(model, names)
    if not check_fingerprints:
        warnings.warn(
            "apply_bundle: fingerprint check skipped; a bundle made for other weights would go unnoticed",
            stacklevel=2,
        )
    targets = {}
    for name in names:
        mod = model.get_submodule(mapping[name])
        if isinstance(mod, PlateLinear):
            raise BundleError(f"module '{mapping[name]}' is already a PLATE layer; merge or unload it first")
        check_module_against_record(mod, mapping[name], b.record(name), check_fingerprints)
        targets[name] = mod
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = []
    identity = bundle_identity(b)
    for name, mod in targets.items():
        q = b.q(name, dtype=q_dtype)
        layer = PlateLinear(mod, b.b_idx(name), q, rho=rho)
        layer.bundle_name = name
        layer.bundle_record_fingerprint = b.record(name).fingerprint
        layer.bundle_identity = identity
        _set_submodule(model, mapping[name], layer)
        trainable.append(layer.plate_A)
    return trainable


def plate_layers(model: nn.Module) -> dict[str, PlateLinear]:
    """The model's PLATE layers by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PlateLinear)}


def merge_all(model: nn.Module) -> None:
    """merge() every PLATE layer."""
    for layer in plate_layers(model).values():
        layer.merge()


def unmerge_all(model: nn.Module) -> None:
    """unmerge() every PLATE layer."""
    for layer in plate_layers(model).values():
        layer.unmerge()


def unload(model: nn.Module, merge: bool = True) -> nn.Module:
    """Replace every PLATE layer by its base layer (merged first unless ``merge=False``); returns the model."""
    for name, layer in plate_layers(model).items():
        if merge:
            layer.merge()
        else:
            layer.unmerge()
        layer._saved_rows = None
        _set_submodule(model, name, layer.base)
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
    """Write every PLATE layer's A (key ``<bundle module>.plate_A``) and the bundle's identity to a safetensors file."""
    from safetensors.torch import save_file

    layers = plate_layers(model)
    if not layers:
        raise ConfigError("the model has no PLATE layers to save; call apply_bundle first")
    tensors, digests, fingerprints, identity, rho = {}, {}, {}, None, None
    for layer in layers.values():
        name = getattr(layer, "bundle_name", None)
        if name is None:
            raise ConfigError("a PLATE layer was not created by apply_bundle; cannot record its bundle identity")
        tensors[f"{name}.plate_A"] = layer.plate_A.detach().to("cpu").contiguous()
        digests[name] = plate_digest(layer.plate_B_idx, layer.plate_Q)
        fingerprints[name] = layer.bundle_record_fingerprint
        identity = identity or layer.bundle_identity
        rho = layer.rho
    meta = {
        "format": ADAPTER_FORMAT,
        "format_version": str(ADAPTER_VERSION),
        "bundle_path": identity["bundle_path"],
        "source_signature": identity["source_signature"],
        "source": json.dumps(identity["source"]),
        "fingerprints": json.dumps(fingerprints),
        "plate_digests": json.dumps(digests),
        "rho": repr(rho),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def read_adapter(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(A tensors by bundle module name, metadata with JSON fields decoded)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: adapter file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k.removesuffix(".plate_A"): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise BundleError(f"{path}: not a readable safetensors adapter ({e})") from None
    if meta.get("format") != ADAPTER_FORMAT:
        raise BundleError(f"{path}: not a PLATE adapter (format {meta.get('format')!r})")
    for key in ("fingerprints", "plate_digests", "source"):
        meta[key] = json.loads(meta.get(key, "null") or "null")
    meta["rho"] = float(meta.get("rho", "0.5"))
    return tensors, meta


def load_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    bundle: Bundle | str | os.PathLike | None = None,
    check_fingerprints: bool = True,
) -> list[nn.Parameter]:
    """Load a saved adapter into the model's PLATE layers (applying its bundle first if the model has none).

    Refuses (BundleError) an adapter whose weight fingerprints, B/Q geometry or shapes differ from the layers'.
    """
    tensors, meta = read_adapter(path)
    layers = plate_layers(model)
    if not layers:
        b = bundle if bundle is not None else meta["bundle_path"]
        apply_bundle(model, b, rho=meta["rho"], modules=list(tensors), check_fingerprints=check_fingerprints)
        layers = plate_layers(model)
    by_name = {getattr(layer, "bundle_name", n): layer for n, layer in layers.items()}
    if set(by_name) != set(tensors):
        extra = sorted(set(tensors) ^ set(by_name))
        raise BundleError(f"{path}: adapter modules and the model's PLATE layers differ (e.g. '{extra[0]}')")
    for name, a in tensors.items():
        layer = by_name[name]
        if meta["fingerprints"].get(name) != getattr(layer, "bundle_record_fingerprint", None):
            raise BundleError(f"{path}: adapter for module '{name}' was trained on other weights (fingerprint differs)")
        if meta["plate_digests"].get(name) != plate_digest(layer.plate_B_idx, layer.plate_Q):
            raise BundleError(f"{path}: adapter for module '{name}' was trained with another bundle (B/Q differ)")
        if tuple(a.shape) != tuple(layer.plate_A.shape):
            raise BundleError(f"{path}: A of '{name}' is {list(a.shape)}, the layer needs {list(layer.plate_A.shape)}")
    with torch.no_grad():
        for name, a in tensors.items():
            layer = by_name[name]
            layer.plate_A.copy_(a.to(layer.plate_A.dtype))
            layer.rho = meta["rho"]
    return [by_name[n].plate_A for n in tensors]
