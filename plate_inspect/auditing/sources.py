"""Where an update comes from: a full fine-tuned checkpoint, a PEFT LoRA adapter or a PLATE adapter (open_update)."""

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plate_inspect.auditing.updates import (
    Delta,
    LowRankDelta,
    coarser,
    quantized_storage,
    rounding_reference,
    storage_label,
)
from plate_inspect.bundle import Bundle
from plate_inspect.checkpoint import (
    Checkpoint,
    parse_safetensors_header,
)
from plate_inspect.dtypes import DTYPES
from plate_inspect.errors import BundleError, CheckpointError, ConfigError
from plate_inspect.targets import (
    CONV1D_FAMILIES,
    TargetModule,
    load_target,
    modules_by_name,
)

_PEFT_PREFIX = "base_model.model."


# --------------------------------------------------------------------------- where the update comes from
def resolve_names(wanted: list[str], available: list[str], what: str) -> dict[str, str]:
    """Map adapter module names onto checkpoint module names: exact, else the unique suffix match either way."""
    have = set(available)
    out: dict[str, str] = {}
    for name in wanted:
        if name in have:
            out[name] = name
            continue
        cands = _suffix_match(name, available)
        if len(cands) != 1:
            why = "no module" if not cands else f"{len(cands)} modules ({', '.join(cands[:3])})"
            raise CheckpointError(f"{what}: module '{name}' matches {why} of the base checkpoint")
        out[name] = cands[0]
    return out


def _suffix_match(name: str, available: list[str]) -> list[str]:
    """The modules of ``available`` that ``name`` is a dotted suffix of, else those that are a dotted suffix of it."""
    return [a for a in available if a.endswith("." + name)] or [a for a in available if name.endswith("." + a)]


def _match_pattern(patterns: dict[str, Any], key: str) -> str | None:
    """PEFT's rank_pattern/alpha_pattern lookup: the first pattern p with re.match('(.*\\.)?(p)$', key)."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return None


class UpdateSource:
    """Where dW comes from. ``modules``: base-checkpoint module names it touches (None: every target)."""

    bundle: Bundle | None = None

    def bind(self, base: Checkpoint) -> list[str] | None:
        """Resolve the update's module names against the base checkpoint; return them (None: all targets)."""
        return None

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        """dW of one module, oriented d_out x d_in like ``base_weight`` (dense or low-rank)."""
        raise NotImplementedError


@dataclass
class CheckpointUpdate(UpdateSource):
    """A full fine-tuned checkpoint: dW = W_tuned - W_base, tensor by tensor."""

    tuned: Checkpoint

    def __post_init__(self) -> None:
        self._modules: dict[str, TargetModule] | None = None
        # module -> (TUNED's coarser dtype, ||round(BASE) - BASE||_F), where BASE was rounded to it
        self.rounded: dict[str, tuple[str, float]] = {}
        # module -> BASE's coarser dtype, where TUNED rounded to it is BASE exactly (swapped arguments?)
        self.base_is_rounded_tuned: dict[str, str] = {}

    @property
    def modules(self) -> dict[str, TargetModule]:
        """The tuned checkpoint's modules by name (its own storage: 3-D expert slices, FP8/MXFP4 included)."""
        if self._modules is None:
            self._modules = modules_by_name(self.tuned)
        return self._modules

    def check_targets(self, targets: list[TargetModule], base: Checkpoint) -> None:
        """Before any weight is read: every audited module of BASE is in TUNED with the same [d_out, d_in]."""
        missing = [t for t in targets if t.name not in self.modules]
        if missing and len(missing) == len(targets):
            kinds = model_types(base, self.tuned)
            raise CheckpointError(
                f"{self.tuned.root}: the fine-tuned checkpoint has none of the {len(targets)} modules audited in "
                f"the base {base.root} (e.g. '{missing[0].name}'){kinds}: it is not a fine-tune of that model; "
                "pass as BASE the model TUNED was fine-tuned from"
            )
        if missing:
            raise CheckpointError(
                f"{self.tuned.root}: the fine-tuned checkpoint has no tensor '{missing[0].logical_name}' (the base "
                f"has it{f'; {len(missing)} modules missing in all' if len(missing) > 1 else ''}); pass a complete "
                "checkpoint, or narrow the audit with --target-modules/--layers"
            )
        for t in targets:
            mine = self.modules[t.name]
            if tuple(mine.shape) != tuple(t.shape):
                raise CheckpointError(
                    f"{mine.tensor.file.name}: module '{t.name}' is [d_out, d_in] = {list(mine.shape)} in the "
                    f"fine-tuned checkpoint but {list(t.shape)} in the base; they are not the same architecture"
                )

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        """W_tuned - W_base of one module, dense; a quantized TUNED is compared with BASE rounded to TUNED's codes."""
        mine = self.modules.get(target.name)
        if mine is None:
            raise CheckpointError(
                f"{self.tuned.root}: the fine-tuned checkpoint has no tensor '{target.logical_name}' (the base has it)"
            )
        if tuple(mine.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{mine.tensor.file.name}: module '{target.name}' is [d_out, d_in] = {list(mine.shape)} in the "
                f"fine-tuned checkpoint but {list(target.shape)} in the base; they are not the same architecture"
            )
        stored, _ = load_target(self.tuned, mine)
        tuned = stored.to(base_weight.dtype)
        # FP8/MXFP4 read as float32: round BASE to TUNED's codes at TUNED's own scales
        storage, scale = quantized_storage(self.tuned, mine) or (stored.dtype, None)
        reference = rounding_reference(base_weight, tuned, storage, scale)
        if reference is not base_weight and not torch.equal(reference, base_weight):
            floor = float(torch.linalg.vector_norm(reference - base_weight, dtype=torch.float64))
            self.rounded[target.name] = (storage_label(storage), floor)
        out = tuned - reference
        base_storage = DTYPES[target.tensor.dtype].torch if target.tensor.dtype in DTYPES else None
        if (
            reference is base_weight
            and target.scale_nbytes == 0
            and base_storage is not None
            and base_storage.is_floating_point
            and coarser(stored, base_storage, None)
            and bool(out.any())
            and torch.equal(stored.to(base_storage).to(base_weight.dtype), base_weight)
        ):
            self.base_is_rounded_tuned[target.name] = storage_label(base_storage)
        if not bool(torch.isfinite(out).all()):
            where = f"tensor '{mine.logical_name}'" + (f" (expert {mine.expert})" if mine.expert is not None else "")
            raise CheckpointError(f"{mine.tensor.file.name}: {where} contains NaN or Inf values")
        return out


@dataclass
class LoraUpdate(UpdateSource):
    """A PEFT LoRA adapter dir: dW = s B A, s = alpha/r (alpha/sqrt(r) with rsLoRA), per-module patterns honoured."""

    path: Path
    config: dict[str, Any]
    adapter: Checkpoint
    pairs: dict[str, tuple[str, str]] = field(default_factory=dict)  # peft module name -> (A key, B key)
    mapping: dict[str, str] = field(default_factory=dict)  # base module name -> peft module name

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg.get("use_dora"):
            raise ConfigError(f"{self.path}: DoRA adapters (use_dora) rescale W's columns; audit supports plain LoRA")
        pat = re.compile(r"^(.*)\.lora_A(?:\.[^.]+)?\.weight$")
        for key in self.adapter.tensors:
            if "lora_embedding" in key:
                raise ConfigError(f"{self.path}: '{key}' is an embedding LoRA; audit covers linear layers only")
            hit = pat.match(key)
            if hit:
                b_key = key.replace(".lora_A", ".lora_B", 1)
                if b_key not in self.adapter.tensors:
                    raise CheckpointError(f"{self.path}: has '{key}' but no matching '{b_key}'")
                self.pairs[hit.group(1).removeprefix(_PEFT_PREFIX)] = (key, b_key)
        if not self.pairs:
            raise CheckpointError(f"{self.path}: a LoRA adapter dir without any '*.lora_A.weight' tensor")

    def bind(self, base: Checkpoint) -> list[str]:
        """Map the LoRA's module names onto BASE's; check each lora_A/lora_B pair fits BASE's weight (headers only)."""
        available = [
            n[: -len(".weight")] for n, t in base.tensors.items() if n.endswith(".weight") and len(t.shape) == 2
        ]
        if not any(name in available or _suffix_match(name, available) for name in self.pairs):
            trained_on = self.config.get("base_model_name_or_path")
            example = next(iter(self.pairs))
            raise CheckpointError(
                f"{self.path}: none of the LoRA's {len(self.pairs)} modules (e.g. '{example}') is a module of BASE "
                f"(model_type {base.config.get('model_type')}): the adapter was trained on another model"
                + (f" ({trained_on}, says adapter_config.json)" if trained_on else "")
                + "; pass the model it was trained on as BASE"
            )
        found = resolve_names(list(self.pairs), available, str(self.path))
        self.mapping = {base_name: peft_name for peft_name, base_name in found.items()}
        for base_name, peft_name in self.mapping.items():  # from the headers, before any weight is read
            a_key, b_key = self.pairs[peft_name]
            a_shape, b_shape = (tuple(self.adapter.tensors[k].shape) for k in (a_key, b_key))
            want = tuple(base.tensors[f"{base_name}.weight"].shape)
            if base.config.get("model_type") in CONV1D_FAMILIES:
                want = want[::-1]
            if len(a_shape) != 2 or len(b_shape) != 2 or (b_shape[0], a_shape[1]) != want:
                trained_on = self.config.get("base_model_name_or_path")
                raise CheckpointError(
                    f"{self.path}: the LoRA of '{peft_name}' (lora_A {list(a_shape)}, lora_B {list(b_shape)}) does "
                    f"not fit BASE's weight [d_out, d_in] = {list(want)}: the adapter was trained on another model"
                    + (f" ({trained_on}, says adapter_config.json)" if trained_on else "")
                    + "; pass the model it was trained on as BASE"
                )
        return list(self.mapping)

    def scaling(self, peft_name: str, rank: int) -> float:
        """PEFT's scaling for one module: alpha/r, or alpha/sqrt(r) with use_rslora (patterns first)."""
        cfg = self.config
        r_key = _match_pattern(cfg.get("rank_pattern") or {}, peft_name)
        a_key = _match_pattern(cfg.get("alpha_pattern") or {}, peft_name)
        r = int(cfg["rank_pattern"][r_key]) if r_key else int(cfg.get("r", rank))
        alpha = float(cfg["alpha_pattern"][a_key]) if a_key else float(cfg.get("lora_alpha", r))
        if r != rank:
            raise CheckpointError(
                f"{self.path}: module '{peft_name}' has rank {rank} in the weights but adapter_config.json says {r}"
            )
        return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        """s B A of one module as a low-rank delta (never the dense d_out x d_in product)."""
        peft_name = self.mapping[target.name]
        a_key, b_key = self.pairs[peft_name]
        a, _ = self.adapter.read(a_key)
        b, _ = self.adapter.read(b_key)
        dt = base_weight.dtype
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise CheckpointError(
                f"{self.path}: LoRA tensors of '{peft_name}' have shapes {list(a.shape)}, {list(b.shape)}"
            )
        return LowRankDelta(b.to(dt) * self.scaling(peft_name, a.shape[0]), a.to(dt).contiguous())


@dataclass
class PlateUpdate(UpdateSource):
    """A PLATE adapter: dW = rho A Q^T on B's rows; B and Q come from the adapter's bundle."""

    path: Path
    a_by_name: dict[str, torch.Tensor]  # adapter module name -> A [r, k]
    rho: float | dict[str, float]  # one for every module, or per adapter module name
    bundle: Bundle | None = None
    digests: dict[str, str] | None = None  # save_adapter files: per-module B/Q digests to check
    mapping: dict[str, str] = field(default_factory=dict)  # base module name -> bundle module name
    recorded: str | None = None  # the bundle path the adapter records (where it was looked for)

    def bind(self, base: Checkpoint) -> list[str]:
        """Check the adapter's bundle is the one it was trained with (B/Q digests); map its modules onto BASE's."""
        from plate_inspect.train.core import geometry_digest

        if self.bundle is None:
            where = (
                f"the bundle this adapter was made with, {self.recorded}, is not there (moved or deleted?)"
                if self.recorded
                else "the adapter records no bundle"
            )
            raise BundleError(f"{self.path}: {where}; pass its new place as bundle=DIR (CLI: --bundle)")
        bundle = self.bundle
        to_bundle = resolve_names(list(self.a_by_name), bundle.modules, f"{self.path} (bundle {bundle.path})")
        self.a_by_name = {to_bundle[n]: a for n, a in self.a_by_name.items()}
        if isinstance(self.rho, dict):
            self.rho = {to_bundle[n]: rho for n, rho in self.rho.items()}
        digests = self.digests or {}
        for name in self.a_by_name if digests else []:
            b_idx, k = bundle.b_idx(name), self.a_by_name[name].shape[-1]
            # the digest does not depend on Q's dtype; a plan trains the prefix Q[:, :k]
            if digests.get(name) != geometry_digest(b_idx, bundle.q(name)[:, :k].contiguous()):
                raise BundleError(f"{self.path}: module '{name}' was trained with another bundle (B/Q digest differs)")
        found = resolve_names(list(self.a_by_name), list(modules_by_name(base)), str(self.path))
        self.mapping = {base_name: bundle_name for bundle_name, base_name in found.items()}
        return list(self.mapping)

    def delta(self, target: TargetModule, base_weight: torch.Tensor) -> Delta:
        """rho A Q^T on B's rows of one module, as a low-rank delta (Q cut to A's k when trained from a plan)."""
        name = self.mapping[target.name]
        bundle = self.bundle
        assert bundle is not None  # (bind refused an adapter without one)
        a = self.a_by_name[name].to(base_weight.dtype)
        q = bundle.q(name, dtype=base_weight.dtype)
        if a.ndim != 2 or a.shape[0] != bundle.b_idx(name).numel() or not 1 <= a.shape[1] <= q.shape[1]:
            raise BundleError(f"{self.path}: A of '{name}' is {list(a.shape)}, the bundle's B and Q need r x (<= k)")
        q = q[:, : a.shape[1]]  # an adapter trained from a plan uses the prefix Q[:, :k] (bottom-k eigenspace)
        rho = self.rho[name] if isinstance(self.rho, dict) else self.rho
        return LowRankDelta(rho * a, q.T.contiguous(), bundle.b_idx(name))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def _plate_file_update(path: Path, bundle: Bundle | None) -> PlateUpdate:
    from plate_inspect.train.layer import read_adapter

    tensors, meta = read_adapter(path)
    own = meta.get("bundle_path")
    found = Bundle.load(own) if own and (Path(own) / "manifest.json").exists() else bundle
    rho = float(meta["rho"]) if meta.get("rho") is not None else dict(meta["rhos"])  # per module when they differ
    return PlateUpdate(path, tensors, rho, found, meta.get("plate_digests") or None, recorded=own or None)


def _plate_peft_update(path: Path, config: dict[str, Any], bundle: Bundle | None) -> PlateUpdate:
    adapter = Checkpoint.open(path)
    tensors = {}
    for key in adapter.tensors:
        hit = re.match(r"^(.*)\.plate_A(?:\.[^.]+)?$", key)
        if hit:
            tensors[hit.group(1).removeprefix(_PEFT_PREFIX)] = adapter.read(key)[0].clone()
    if not tensors:
        raise CheckpointError(f"{path}: a PLATE adapter dir without any '*.plate_A' tensor")
    own = config.get("bundle")
    found = Bundle.load(own) if own and (Path(own) / "manifest.json").exists() else bundle
    if found is not None and config.get("bundle_signature") not in (None, found.manifest.source_signature):
        raise BundleError(f"{path}: the adapter was trained with a bundle of other weights (source signature differs)")
    return PlateUpdate(path, tensors, float(config.get("rho", 0.5)), found, recorded=own or None)


def _is_plate_file(path: Path) -> bool:
    try:
        _, meta = parse_safetensors_header(path)
    except CheckpointError:
        return False
    return meta.get("format") == "plate-adapter"


def open_update(
    tuned: str | os.PathLike,
    bundle: Bundle | None = None,
    revision: str | None = None,
    offline: bool | None = None,
) -> UpdateSource:
    """Recognise TUNED: PEFT adapter dir (LoRA or plate), PLATE adapter file (or a dir with one), or a checkpoint."""
    path = Path(tuned).expanduser()
    if path.is_dir() and (path / "adapter_config.json").exists():
        config = _read_json(path / "adapter_config.json")
        peft_type = str(config.get("peft_type", "")).upper()
        if peft_type == "LORA":
            if not (path / "adapter_model.safetensors").exists():
                raise CheckpointError(
                    f"{path}: no adapter_model.safetensors (pickled adapter_model.bin is never opened)"
                )
            return LoraUpdate(path, config, Checkpoint.open(path / "adapter_model.safetensors"))
        if peft_type == "PLATE":
            return _plate_peft_update(path, config, bundle)
        raise ConfigError(f"{path}: PEFT adapter type '{peft_type}' is not supported; audit reads LORA and PLATE")
    if path.is_file() and path.suffix == ".safetensors" and _is_plate_file(path):
        return _plate_file_update(path, bundle)
    if path.is_dir() and not (path / "config.json").exists():
        plate_files = [p for p in sorted(path.glob("*.safetensors")) if _is_plate_file(p)]
        if len(plate_files) == 1:
            return _plate_file_update(plate_files[0], bundle)
    return CheckpointUpdate(Checkpoint.open(tuned, revision=revision, offline=offline))


def model_types(base: Checkpoint, other: Checkpoint) -> str:
    """' (model_type a vs b)' when the two configs name different model types, else ''."""
    a, b = (str(c.config.get("model_type") or "?") for c in (base, other))
    return f" (model_type {b} vs {a} for the base)" if a != b else ""
