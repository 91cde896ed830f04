"""Read safetensors checkpoints lazily: resolve a source, validate shard headers, read one weight at a time.

Nothing here loads a model. A :class:`Checkpoint` knows every tensor's file, dtype, shape and byte range from
the shard headers alone (validated as strictly as safetensors itself validates them);
:meth:`Checkpoint.read_weight` reads exactly one weight's bytes (or one expert's slice of them) and dequantizes
FP8 (per-tensor, per-row or block scales) and MXFP4 storage to float32. Pickle files (``.bin``/``.pt``) are
never opened; packed integer formats (GPTQ, AWQ, bitsandbytes) are refused with a message saying what to do.
A hub repo id is resolved to a local snapshot by :mod:`plate_inspect.hub`.

The jobs it leans on live in their own modules, and their public names are re-exported here (the import path
callers have used): :mod:`plate_inspect.safetensors_header` (header validation, :class:`TensorInfo`),
:mod:`plate_inspect.fingerprints`, :mod:`plate_inspect.dequantize` (FP8, E8M0, MXFP4 decoding),
:mod:`plate_inspect.quantized_layouts` (:class:`LogicalWeight`, supported and refused storage) and
:mod:`plate_inspect.model_files` (which files a directory is read from, refusals of adapters and pickles).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plate_inspect.atomic import path_argument
from plate_inspect.dequantize import (
    FP4_E2M1_VALUES,
    FP8_DTYPES,
    FP8_SCALE_DTYPES,
    broadcast_scale,
    decode_e8m0,
    decode_fp8,
    decode_fp8_scale,
    decode_mxfp4,
    expand_block_scale,
    fp8_scale_problem,
    tensor_from_bytes,
)
from plate_inspect.dtypes import FLOAT_DTYPES
from plate_inspect.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    UnsupportedWeightError,
    dangling_link,
    os_error_advice,
)
from plate_inspect.fingerprints import fingerprint_bytes, fingerprint_parts, fingerprint_tensor
from plate_inspect.model_files import (
    CONVERT_HINT,
    INDEX_FILE,
    PICKLE_SUFFIXES,
    SINGLE_FILE,
    one_shard_note,
    open_sharded,
    read_config,
    read_weight_map,
    refuse_adapter,
    refuse_missing_shards,
    single_file_first,
    single_file_is_read,
)
from plate_inspect.quantized_layouts import (
    COMPRESSED_TENSORS,
    COMPRESSED_TENSORS_FORMATS,
    SUPPORTED_QUANT_METHODS,
    LogicalWeight,
    fold_logical_weights,
    fp8_block_size,
    refuse_packed,
    require_float_dtype,
)
from plate_inspect.safetensors_header import TensorInfo, parse_safetensors_header

__all__ = [
    # defined here
    "Checkpoint",
    "SourceRef",
    # re-exported from the modules that hold them (the import path callers have used)
    "COMPRESSED_TENSORS",
    "COMPRESSED_TENSORS_FORMATS",
    "FLOAT_DTYPES",
    "FP4_E2M1_VALUES",
    "FP8_DTYPES",
    "FP8_SCALE_DTYPES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "SUPPORTED_QUANT_METHODS",
    "LogicalWeight",
    "TensorInfo",
    "decode_e8m0",
    "decode_fp8",
    "decode_fp8_scale",
    "decode_mxfp4",
    "expand_block_scale",
    "fingerprint_bytes",
    "fingerprint_parts",
    "fingerprint_tensor",
    "fp8_scale_problem",
    "parse_safetensors_header",
    "read_weight_map",
    "refuse_adapter",
    "require_float_dtype",
    "single_file_is_read",
]


@dataclass(frozen=True)
class SourceRef:
    """What was scanned: a hub repo (id + revision + resolved commit) or a local path."""

    kind: str  # "hub" | "local"
    id: str
    revision: str | None = None
    commit: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``source`` entry."""
        return {"kind": self.kind, "id": self.id, "revision": self.revision, "commit": self.commit}


@dataclass
class Checkpoint:
    """A safetensors checkpoint opened lazily: headers parsed and validated, no tensor data read yet."""

    root: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    config: dict[str, Any] = field(default_factory=dict)
    source: SourceRef | None = None
    bytes_read: int = 0
    #: what the user should know about how the checkpoint was chosen (files left aside), one line each
    notes: list[str] = field(default_factory=list)
    #: one file given of a sharded checkpoint (an index beside it lists others, or its name numbers it): part of a model
    one_shard: bool = False
    _logical: dict[str, LogicalWeight] | None = field(default=None, init=False, repr=False)

    def __repr__(self) -> str:
        """One short line (a REPL shows it): where, how many files and tensors, the model_type; not every tensor."""
        where = self.source.id if self.source is not None else str(self.root)
        return (
            f"Checkpoint({where!r}, files={len(self.files)}, tensors={len(self.tensors)}, "
            f"model_type={self.config.get('model_type')!r})"
        )

    # ----------------------------------------------------------------- construction
    @classmethod
    def open(cls, source: str | os.PathLike, revision: str | None = None, offline: bool | None = None) -> Checkpoint:
        """Open a local dir, a single ``.safetensors`` file, or a Hugging Face repo id (cache first).

        Args:
            source: a directory with ``*.safetensors`` (+ ``model.safetensors.index.json``), one file, or ``org/name``.
            revision: hub branch, tag or commit (hub sources only).
            offline: never contact the hub (default: ``HF_HUB_OFFLINE``).

        Returns:
            The checkpoint with every header validated. Raises a :class:`CheckpointError` subclass on bad input.
        """
        path = path_argument(source, "source").expanduser()
        if revision is not None and not isinstance(revision, str):
            raise ConfigError(f"revision must be a branch, tag or commit (str) or None, got {revision!r:.80}")
        if path.exists() and revision is not None:  # it would be ignored: the user believes a revision was read
            raise ConfigError(
                f"{source}: is a local path, so revision={revision} (CLI: --revision) does not apply (it picks a "
                "hub repo's branch, tag or commit); drop it, or give the repo id (org/name)"
            )
        if path.exists():
            ckpt = cls._open_local(path)
            ckpt.source = SourceRef("local", str(path.resolve()))
            return ckpt
        from plate_inspect import hub  # (imports plate_inspect.checkpoint: the reader's rule for which files to fetch)

        if hub.looks_like_repo_id(str(source)):
            root, commit = hub.resolve_hub_snapshot(str(source), revision=revision, offline=offline)
            ckpt = cls._open_local(root)
            ckpt.source = SourceRef("hub", str(source), revision or "main", commit)
            return ckpt
        link = dangling_link(path)
        if link is not None:  # exists() follows the link: it is a path, but not one to read
            raise CheckpointError(f"{path}: cannot read: No such file or directory; {link}")
        raise CheckpointError(f"'{source}' is neither an existing path nor a Hugging Face repo id (org/name)")

    @classmethod
    def _open_local(cls, path: Path) -> Checkpoint:
        if path.is_file():
            if path.suffix != ".safetensors":
                if path.suffix in PICKLE_SUFFIXES:
                    raise UnsupportedWeightError(
                        f"{path}: pickle checkpoints are never opened (unpickling can run arbitrary code); "
                        + CONVERT_HINT
                    )
                raise CheckpointError(
                    f"{path}: not a .safetensors file; give a model directory or one of its .safetensors files"
                )
            tensors, _ = parse_safetensors_header(path)
            config = path.parent / "config.json"
            if not config.exists() and path.is_symlink():  # a link to a model's file: the config is beside the file
                config = path.resolve().parent / "config.json"
            notes = one_shard_note(path)
            ckpt = cls(path.parent, [path], tensors, read_config(config), notes=notes, one_shard=bool(notes))
        else:
            root = path
            index_path = root / INDEX_FILE
            weight_map = read_weight_map(index_path) if index_path.exists() else None
            single, notes = single_file_first(root, weight_map)
            if single is not None:
                tensors, _ = parse_safetensors_header(single)
                ckpt = cls(root, [single], tensors, read_config(root / "config.json"), notes=notes)
                refuse_packed(ckpt.tensors)
                return ckpt
            if weight_map is not None:
                files, tensors, notes = open_sharded(root, index_path, weight_map)
            else:
                files = sorted(p for p in root.glob("*.safetensors"))
                if not files:
                    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
                    if pickles:
                        raise UnsupportedWeightError(
                            f"{root}: only pickle weights found ({', '.join(pickles)}); plate-inspect reads "
                            f"safetensors only and never unpickles; " + CONVERT_HINT
                        )
                    raise CheckpointError(
                        f"{root}: no .safetensors files found; give a Hugging Face model directory (model.safetensors, "
                        "or shards with model.safetensors.index.json), a .safetensors file, or a hub repo id"
                    )
                refuse_missing_shards(root, files)
                tensors = {}
                for f in files:
                    entries, _ = parse_safetensors_header(f)
                    twice = sorted(set(entries) & set(tensors))
                    if twice:
                        raise CorruptCheckpointError(
                            f"{f}: tensor '{twice[0]}' is also in {tensors[twice[0]].file.name}; "
                            "a directory must hold one checkpoint"
                        )
                    tensors.update(entries)
            ckpt = cls(root, files, tensors, read_config(root / "config.json"), notes=notes)
        refuse_packed(ckpt.tensors)
        return ckpt

    # ----------------------------------------------------------------- logical weights
    def logical_weights(self) -> dict[str, LogicalWeight]:
        """Every weight by its logical name, with logical (dequantized) shape and storage format.

        FP8 scales (``<name>_scale_inv``, ``<name>_scale``) and MXFP4 ``<name>_blocks``/``<name>_scales`` are
        folded into the weight they belong to and never appear on their own.
        """
        if self._logical is None:
            declared = isinstance(self.config.get("quantization_config"), dict)
            self._logical = fold_logical_weights(self.tensors, fp8_block_size(self.config), declared)
        return self._logical

    def logical_weight(self, name: str) -> LogicalWeight:
        """The logical weight named ``name`` (a companion scale/blocks tensor name is refused with a hint)."""
        weights = self.logical_weights()
        if name in weights:
            return weights[name]
        owner = next((w.name for w in weights.values() if name in w.parts), None)
        if owner is not None:
            raise CheckpointError(f"tensor '{name}' is part of the quantized weight '{owner}'; read '{owner}'")
        if f"{name}.weight" in weights:  # a module's name, as bundles and scans name modules
            raise CheckpointError(
                f"{self.root}: the checkpoint has no weight named '{name}' (a module's name); read its weight "
                f"'{name}.weight'"
            )
        raise CheckpointError(
            f"{self.root}: the checkpoint has no weight named '{name}'; Checkpoint.logical_weights() lists its weights"
        )

    # ----------------------------------------------------------------- reading
    def read_bytes(self, name: str, start: int = 0, length: int | None = None) -> bytearray:
        """Read one stored tensor's bytes (its whole byte range, or ``length`` bytes from ``start`` within it)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: the checkpoint has no tensor named '{name}'")
        length = info.nbytes - start if length is None else length
        if start < 0 or length < 0 or start + length > info.nbytes:
            raise CheckpointError(f"tensor '{name}': byte range [{start}, {start + length}) is outside the tensor")
        buf = bytearray(length)
        try:
            with open(info.file, "rb") as f:
                f.seek(info.start + start)
                got = f.readinto(buf)
        except OSError as e:
            raise CheckpointError(
                f"{info.file}: cannot read tensor '{name}': {e.strerror or e}; {os_error_advice(e)}"
            ) from None
        if got != length:
            raise CorruptCheckpointError(f"{info.file}: file is truncated while reading tensor '{name}'")
        self.bytes_read += length
        return buf

    def read(self, name: str) -> tuple[torch.Tensor, str]:
        """One stored floating tensor in its stored dtype (a view of freshly read bytes) and its fingerprint."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: the checkpoint has no tensor named '{name}'")
        dtype = require_float_dtype(info, dequantized=False)
        raw = self.read_bytes(name)
        return tensor_from_bytes(raw, dtype, info.shape), fingerprint_bytes(raw)

    def read_weight(self, name: str, expert: int | None = None) -> tuple[torch.Tensor, str]:
        """A weight as a floating tensor of its logical shape, and the fingerprint of the bytes it came from.

        The one read path of the scanner. Dense weights come in their stored dtype; FP8 and MXFP4 weights are
        dequantized exactly to float32 (the fingerprint covers the stored bytes and the scales).

        Args:
            name: the logical weight name (see :meth:`logical_weights`).
            expert: for a weight with experts on its first dimension (3-D or more), read only expert ``expert``'s
                slice (and its scales): the result has the logical shape without the first dimension.
        """
        weight = self._decodable(name, expert)
        if weight.format == "fp8":
            return self._read_fp8(weight, expert)
        if weight.format == "mxfp4":
            return self._read_mxfp4(weight, expert)
        info = self.tensors[weight.parts[0]]
        dtype = require_float_dtype(info, dequantized=False)
        raw = self._read_slice(info, expert)
        return tensor_from_bytes(raw, dtype, _sliced(info.shape, expert)), fingerprint_bytes(raw)

    def weight_fingerprint(self, name: str, expert: int | None = None) -> str:
        """The fingerprint :meth:`read_weight` returns, computed from the stored bytes alone (no decoding)."""
        weight = self._decodable(name, expert)
        return fingerprint_parts(
            [self._read_slice(self.tensors[p], _part_expert(weight, p, expert)) for p in weight.parts]
        )

    def _decodable(self, name: str, expert: int | None, storage: str | None = None) -> LogicalWeight:
        """Logical weight ``name``, checked before any byte is read: ``expert`` within its first dimension, its
        storage decodable, and (``storage``: 'fp8' or 'mxfp4') stored that way."""
        weight = self.logical_weight(name)
        if storage is not None and weight.format != storage:
            raise CheckpointError(
                f"{self.root}: weight '{name}' is not stored in {storage.upper()} ({weight.stored_dtype})"
            )
        if expert is not None:
            _check_expert(weight, expert)
        _require_decodable(weight)
        return weight

    def _read_slice(self, info: TensorInfo, expert: int | None) -> bytearray:
        """A stored tensor's bytes, or only the byte range of slice ``expert`` along its first dimension."""
        if expert is None:
            return self.read_bytes(info.name)
        per_expert = info.nbytes // info.shape[0]
        return self.read_bytes(info.name, expert * per_expert, per_expert)

    def fp8_scale(self, name: str, expert: int | None = None) -> torch.Tensor | None:
        """The per-element dequantization scale of FP8 weight ``name`` (expert ``expert``'s slice), broadcast to its
        logical shape (a 0-d tensor for a per-tensor scale); None for a plain FP8 cast without scales. Checked as
        :meth:`read_weight` checks it. Used by ``audit`` to round BASE to TUNED's FP8 grid."""
        weight = self._decodable(name, expert, "fp8")
        if len(weight.parts) == 1:
            return None
        shape = _sliced(self.tensors[weight.parts[0]].shape, expert)
        scale, _ = self._fp8_scale(weight, expert)
        return broadcast_scale(scale, shape, weight.block)

    def mxfp4_scale(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The per-element dequantization scale 2^(e8m0 - 127) of MXFP4 weight ``name`` (expert ``expert``'s
        slice) in its logical shape: each 32-element block's scale repeated over it; a NaN code (255) gives NaN.
        Reads the scales only. Used by ``audit`` to round BASE to TUNED's MXFP4 grid (the twin of :meth:`fp8_scale`)."""
        weight = self._decodable(name, expert, "mxfp4")
        info = self.tensors[weight.parts[1]]
        codes = tensor_from_bytes(self._read_slice(info, expert), torch.uint8, _sliced(info.shape, expert))
        return decode_e8m0(codes).repeat_interleave(weight.shape[-1] // info.shape[-1], dim=-1)

    def _fp8_scale(self, weight: LogicalWeight, expert: int | None) -> tuple[torch.Tensor, bytearray]:
        """The flat stored scale of an FP8 weight (expert ``expert``'s share), checked, and its raw bytes."""
        info = self.tensors[weight.parts[0]]
        scale_info = self.tensors[weight.parts[1]]
        scale_expert = _part_expert(weight, scale_info.name, expert)
        scale_raw = self._read_slice(scale_info, scale_expert)
        scale = decode_fp8_scale(scale_raw, scale_info.dtype)
        bad = fp8_scale_problem(scale)
        if bad:
            at = _unravel(bad[1], _sliced(scale_info.shape, scale_expert), scale_expert)
            raise CorruptCheckpointError(
                f"{scale_info.file.name}: tensor '{scale_info.name}' (scale of '{info.name}'"
                + (f", expert {expert}" if expert is not None else "")
                + f") holds {bad[0]} ({f'first at {at} = ' if at else ''}{bad[2]}): FP8 scales are positive finite "
                "magnitudes (a quantizer stores amax / FP8 max), so the file is damaged; re-download it"
            )
        return scale, scale_raw

    def _read_fp8(self, weight: LogicalWeight, expert: int | None) -> tuple[torch.Tensor, str]:
        info = self.tensors[weight.parts[0]]
        raw = self._read_slice(info, expert)
        shape = _sliced(info.shape, expert)
        values = decode_fp8(raw, info.dtype, shape)
        if len(weight.parts) == 1:  # a plain cast: the values are the weight
            return values, fingerprint_bytes(raw)
        scale, scale_raw = self._fp8_scale(weight, expert)
        # an F64 scale is applied in float64 and rounded once; an FP8 value times an F32/BF16/F16 scale is rounded once
        # in float32 already (float32 products are correctly rounded: the same value as float64, then rounding)
        work = torch.float64 if scale.dtype == torch.float64 else torch.float32
        values = (values.to(work) * broadcast_scale(scale.to(work), shape, weight.block)).to(torch.float32)
        return values, fingerprint_parts([raw, scale_raw])

    def _read_mxfp4(self, weight: LogicalWeight, expert: int | None) -> tuple[torch.Tensor, str]:
        blocks_info, scales_info = (self.tensors[p] for p in weight.parts)
        blocks_raw = self._read_slice(blocks_info, expert)
        scales_raw = self._read_slice(scales_info, expert)
        blocks = tensor_from_bytes(blocks_raw, torch.uint8, _sliced(blocks_info.shape, expert))
        scales = tensor_from_bytes(scales_raw, torch.uint8, _sliced(scales_info.shape, expert))
        return decode_mxfp4(blocks, scales), fingerprint_parts([blocks_raw, scales_raw])

    def signature(self) -> str:
        """A cheap identity of the checkpoint: names, dtypes, shapes, byte ranges and file sizes."""
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}|{t.dtype}|{t.shape}|{t.file.name}|{t.start}|{t.end}\n".encode())
        for f in self.files:
            h.update(f"{f.name}:{f.stat().st_size}\n".encode())
        return "sha256:" + h.hexdigest()

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())


def _sliced(shape: tuple[int, ...], expert: int | None) -> tuple[int, ...]:
    return shape if expert is None else shape[1:]


def _unravel(flat: int, shape: tuple[int, ...], expert: int | None) -> list[int]:
    """A flat index into a tensor (or into expert ``expert``'s slice of it) -> its index in the stored tensor."""
    index = []
    for d in reversed(shape):
        index.append(flat % d if d else 0)
        flat = flat // d if d else 0
    return ([] if expert is None else [expert]) + index[::-1]


def _require_decodable(weight: LogicalWeight) -> None:
    """A quantized weight whose scales are missing or malformed cannot be read: say which and why."""
    if weight.problem:
        raise CorruptCheckpointError(weight.problem)


def _check_expert(weight: LogicalWeight, expert: int) -> None:
    """Expert slices index the first dimension of a weight with 3+ dims."""
    if len(weight.shape) < 3:
        raise CheckpointError(
            f"weight '{weight.name}' has shape {list(weight.shape)}: expert slices need experts on the first of 3+ dims"
        )
    if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < weight.shape[0]:
        raise CheckpointError(f"weight '{weight.name}': expert {expert!r} out of range (it has {weight.shape[0]})")


def _part_expert(weight: LogicalWeight, part: str, expert: int | None) -> int | None:
    """The expert index to slice a part with: a per-tensor FP8 scale (no block) is shared by all experts."""
    if weight.format == "fp8" and part != weight.parts[0] and weight.block is None:
        return None
    return expert


def __getattr__(name: str) -> object:
    """The hub's names at their earlier place (``plate_inspect.checkpoint.resolve_hub_snapshot``): now in
    :mod:`plate_inspect.hub`, which imports this module."""
    if name in ("resolve_hub_snapshot", "hub_weight_files"):
        from plate_inspect import hub

        return getattr(hub, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
