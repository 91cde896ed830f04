"""Read safetensors checkpoints lazily: resolve a source, validate shard headers, read one weight at a time.

Nothing here loads a model. A :class:`Checkpoint` knows every tensor's file, dtype, shape and byte range from
the shard headers alone (validated as strictly as safetensors itself validates them);
:meth:`Checkpoint.read_weight` reads exactly one weight's bytes (or one expert's slice of them) and dequantizes
FP8 (per-tensor, per-row or block scales) and MXFP4 storage to float32. Pickle files (``.bin``/``.pt``) are
never opened; packed integer formats (GPTQ, AWQ, bitsandbytes) are refused with a message saying what to do.
A hub repo id is resolved to a local snapshot by :mod:`plate_inspect.hub`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plate_inspect.atomic import path_argument
from plate_inspect.dtypes import DTYPES, FLOAT_DTYPES
from plate_inspect.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    UnsupportedWeightError,
    dangling_link,
    os_error_advice,
)

__all__ = [
    "FLOAT_DTYPES",
    "Checkpoint",
    "LogicalWeight",
    "SourceRef",
    "TensorInfo",
    "fingerprint_bytes",
    "fingerprint_tensor",
    "parse_safetensors_header",
    "require_float_dtype",
]

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_MAX_INDEX = 1 << 64  # offsets, dims and sizes beyond u64 cannot describe a real file
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_CONVERT_HINT = (
    "convert it once with transformers: AutoModel.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)"
)
_DEQUANTIZE_HINT = (
    "scan the unquantized base model it was made from, or dequantize it to bf16 first "
    "(transformers: AutoModelForCausalLM.from_pretrained(DIR, torch_dtype=torch.bfloat16).dequantize()"
    ".save_pretrained(OUT))"
)
#: quantization_config.quant_method values whose storage plate-inspect reads (dequantizing on read).
SUPPORTED_QUANT_METHODS = frozenset({"fp8", "fbgemm_fp8", "mxfp4"})
#: compressed-tensors (llm-compressor) stores weights unpacked in these formats: FP8 codes + ``weight_scale``
#: (per tensor, per row [rows, 1] or per block), or plain floats; packed integer formats are refused.
COMPRESSED_TENSORS = "compressed-tensors"
COMPRESSED_TENSORS_FORMATS = frozenset({"float-quantized", "naive-quantized", "dense"})
#: FP8 element formats dequantized on read (OCP FP8: E4M3 "fn" with NaN only at S.1111.111, E5M2 IEEE-like).
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: Tensor-name endings of packed integer formats, with the format they belong to.
_PACKED_SUFFIXES = {
    ".qweight": "GPTQ/AWQ",
    ".qzeros": "GPTQ/AWQ",
    ".g_idx": "GPTQ",
    ".absmax": "bitsandbytes 4-bit",
    ".quant_map": "bitsandbytes 4-bit",
    ".nested_absmax": "bitsandbytes 4-bit",
    ".quant_state.bitsandbytes__nf4": "bitsandbytes 4-bit (nf4)",
    ".quant_state.bitsandbytes__fp4": "bitsandbytes 4-bit (fp4)",
    ".SCB": "bitsandbytes 8-bit",
    ".weight_packed": "compressed-tensors packed integers",
}
#: The same for names other models may use for float tensors too: refused only when the tensor is integer-typed.
_PACKED_INT_SUFFIXES = {
    ".q_weight": "EXL2",
    ".q_invperm": "EXL2",
    ".W_q": "HQQ",
    ".codes": "AQLM",
}
#: Tensor-name pieces of LoRA-style adapters (PEFT, diffusers/kohya): an adapter, not a model to scan.
_LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_down.", ".lora_up.", ".lora_embedding_A", ".lora_embedding_B")
#: The one-file checkpoint name transformers loads first, before a sharded index (``from_pretrained``'s order).
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: FP4 E2M1 values by 4-bit code (OCP Microscaling Formats v1.0, section 5.3.3): sign, 2 exponent bits, 1 mantissa.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor's bytes live, from the shard header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in file
    end: int

    @property
    def nbytes(self) -> int:
        """Stored bytes of the tensor."""
        return self.end - self.start


@dataclass(frozen=True)
class LogicalWeight:
    """A weight as a model sees it: logical name and shape, and the stored tensors it is decoded from.

    ``format`` is ``"dense"`` (F64/F32/F16/BF16, read as stored), ``"fp8"`` (F8_E4M3/F8_E5M2 times a scale:
    per tensor, per expert, per row or per block), ``"mxfp4"`` (``<name>_blocks`` + ``<name>_scales``) or
    ``"other"`` (integer/bool/unsupported storage: reading it raises :class:`UnsupportedWeightError`). A quantized
    weight whose scale is missing or malformed keeps its place with a ``problem``, raised when it is read.
    ``parts`` are the stored tensor names (the weight first, then its scales); ``block`` is the FP8 scale block
    [rows, cols] (None for per-tensor scales). ``dtype`` and ``file`` mirror :class:`TensorInfo`.
    """

    name: str
    shape: tuple[int, ...]
    stored_dtype: str  # the weight part's dtype ("BF16", "F8_E4M3", ...) or "MXFP4"
    format: str
    parts: tuple[str, ...]
    file: Path
    block: tuple[int, int] | None = None
    problem: str = ""  # why it cannot be decoded (a missing or malformed scale): raised when it is read

    @property
    def dtype(self) -> str:
        """The stored dtype, under TensorInfo's name for it (so either record fits require_float_dtype)."""
        return self.stored_dtype

    @property
    def is_quantized(self) -> bool:
        """Stored as FP8 or MXFP4 codes with scales (read dequantized to float32)."""
        return self.format in ("fp8", "mxfp4")


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


# --------------------------------------------------------------------------- header validation
def parse_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header as strictly as safetensors does.

    Every entry needs a known dtype, a shape of non-negative integers and two integer ``data_offsets``; sizes
    are computed in bits (F4, F6 are not whole bytes); the byte ranges, sorted, must be contiguous from 0 and
    cover the data section exactly (no gap, no overlap, no trailing bytes). Raises
    :class:`CorruptCheckpointError` naming the file and tensor.
    """
    path = path_argument(path, "path")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpointError(f"{path}: file is truncated ({size} bytes): not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or n > size - 8:
                raise CorruptCheckpointError(
                    f"{path}: corrupt or truncated safetensors header (header length {n}, file size {size}); "
                    "re-download this file"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}; {os_error_advice(e)}") from None
    header = _parse_header_json(path, raw)
    metadata = _header_metadata(path, header.pop("__metadata__", None))
    data_start, data_len = 8 + n, size - 8 - n
    entries = {name: _header_entry(path, name, spec, data_start) for name, spec in header.items()}
    _check_layout(path, entries, data_start, data_len)
    return entries, metadata


def _corrupt(path: Path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: corrupt safetensors header: {what}; re-download or re-save this file")


def _parse_header_json(path: Path, raw: bytes) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise _corrupt(path, "the header does not start with '{'")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _corrupt(path, f"key '{key}' appears twice")
            out[key] = value
        return out

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise _corrupt(path, f"invalid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "not a JSON object")
    return header


def _header_metadata(path: Path, metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    return metadata


def _is_index(value: Any) -> bool:
    """A JSON integer in [0, 2^64): not a bool, float or string."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INDEX


def _header_entry(path: Path, name: str, spec: Any, data_start: int) -> TensorInfo:
    where = f"tensor '{name}'"
    if not isinstance(spec, dict):
        raise _corrupt(path, f"{where}: entry is {type(spec).__name__}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in spec]
    if missing:
        raise _corrupt(path, f"{where}: entry lacks {', '.join(missing)}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _corrupt(path, f"{where}: unknown dtype {dtype!r} (safetensors defines {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
        raise _corrupt(path, f"{where}: shape must be a list of non-negative integers, got {shape!r:.100}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(o) for o in offsets):
        raise _corrupt(path, f"{where}: data_offsets must be two non-negative integers, got {offsets!r:.100}")
    begin, end = offsets
    if end < begin:
        raise _corrupt(path, f"{where}: data_offsets [{begin}, {end}] end before they begin")
    n_bits = DTYPES[dtype].bits
    for d in shape:  # checked arithmetic: stop as soon as the size cannot fit in a file
        n_bits *= d
        if n_bits >= _MAX_INDEX * 8:
            raise _corrupt(path, f"{where}: {dtype}{shape} is too large to be stored (size overflows)")
    if n_bits % 8:
        raise _corrupt(path, f"{where}: {dtype}{shape} is {n_bits} bits, not a whole number of bytes")
    if end - begin != n_bits // 8:
        raise _corrupt(path, f"{where}: has {end - begin} bytes but {dtype}{shape} needs {n_bits // 8}")
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _check_layout(path: Path, entries: dict[str, TensorInfo], data_start: int, data_len: int) -> None:
    """Byte ranges sorted by offset must tile [0, data_len) exactly: no overlap, no gap, nothing after the last."""
    cursor, previous = 0, None
    for info in sorted(entries.values(), key=lambda t: (t.start, t.end)):
        begin = info.start - data_start
        if begin < cursor:
            raise _corrupt(path, f"tensor '{info.name}' overlaps tensor '{previous}' (bytes {begin} < {cursor})")
        if begin > cursor:
            after = f"after tensor '{previous}'" if previous else "before the first tensor"
            raise _corrupt(path, f"a gap of {begin - cursor} bytes {after}, before tensor '{info.name}'")
        cursor, previous = info.end - data_start, info.name
    if cursor > data_len:
        raise CorruptCheckpointError(
            f"{path}: file is truncated: tensor '{previous}' ends at byte {data_start + cursor} but the file "
            f"has {data_start + data_len} bytes; re-download this file"
        )
    if cursor < data_len:
        raise _corrupt(path, f"{data_len - cursor} bytes after the last tensor's data are not described")


# --------------------------------------------------------------------------- fingerprints
def fingerprint_bytes(data: bytes | bytearray | memoryview) -> str:
    """Identity of a weight: sha256 of its stored bytes (dtype and layout as in the checkpoint)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fingerprint_parts(parts: list[bytes | bytearray]) -> str:
    """Identity of a weight stored in several tensors (FP8 + scales, MXFP4 blocks + scales): length-prefixed sha256.

    A single part gives the same value as :func:`fingerprint_bytes`, so dense weights keep their fingerprint.
    """
    if len(parts) == 1:
        return fingerprint_bytes(parts[0])
    h = hashlib.sha256()
    for data in parts:
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return "sha256:" + h.hexdigest()


def fingerprint_tensor(tensor: torch.Tensor, block_bytes: int = 64 << 20) -> str:
    """The same fingerprint, computed from an in-memory tensor (e.g. a loaded model's parameter).

    Hashed in blocks copied to the CPU: numpy never sees the tensor's own storage (that would make it non-resizable,
    and FSDP2 frees an unsharded parameter by resizing its storage), and no copy of the whole weight is made.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fingerprint_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    flat = tensor.detach().contiguous().reshape(-1)
    h = hashlib.sha256()
    step = max(1, block_bytes // max(flat.element_size(), 1))
    for i in range(0, flat.numel(), step):
        h.update(flat[i : i + step].to("cpu", copy=True).view(torch.uint8).numpy().data)  # memoryview: no copy
    return "sha256:" + h.hexdigest()


# --------------------------------------------------------------------------- dequantization (pure functions)
def decode_fp8(raw: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """FP8 bytes (F8_E4M3 or F8_E5M2) -> float32 values of the given shape (exact: every FP8 value is a float32)."""
    torch_dtype = DTYPES[dtype].torch
    if torch_dtype is None:
        raise UnsupportedWeightError(f"this torch build has no {dtype} dtype; upgrade torch to read FP8 weights")
    if not raw:
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape).to(torch.float32)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(rows/br), ceil(cols/bc)] block scale grid -> the [rows, cols] per-element scale (edges cut off)."""
    br, bc = block
    return scale.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]


#: Stored dtypes of FP8 weight scales: IEEE floats, or unsigned power-of-two exponents (UE8M0, as transformers'
#: fine-grained FP8 accepts for ``weight_scale_inv``).
FP8_SCALE_DTYPES = (*FLOAT_DTYPES, "F8_E8M0")


def decode_fp8_scale(raw: bytearray, dtype: str) -> torch.Tensor:
    """A flat FP8 scale tensor's bytes -> its values: floats as stored (F64 kept), F8_E8M0 codes as 2^(code - 127)."""
    if dtype == "F8_E8M0":
        return decode_e8m0(_view(raw, torch.uint8, (len(raw),)))
    return _view(raw, FLOAT_DTYPES[dtype], (len(raw) * 8 // DTYPES[dtype].bits,))


def fp8_scale_problem(scale: torch.Tensor) -> tuple[str, int, float] | None:
    """Why a (flat) FP8 scale tensor cannot be a quantizer's output, or None: every scale must be finite and > 0.

    Quantizers store scale = amax / FP8 max (transformers' fine-grained FP8 stores 1.0 for an all-zero block,
    llm-compressor and fbgemm clamp to a tiny positive minimum), and the unsigned UE8M0 scale format has no sign:
    NaN, infinity, zero and negative scales are damage (a negative one decodes to a weight with a block's sign
    flipped, a model nobody trained). Returns (counts by kind, flat index of the first bad scale, its value).
    """
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return None
    kinds = {
        "NaN": torch.isnan(scale),
        "infinite": torch.isinf(scale),
        "zero": scale == 0,
        "negative": torch.isfinite(scale) & (scale < 0),
    }
    counts = [f"{int(m.sum())} {kind}" for kind, m in kinds.items() if bool(m.any())]
    total = scale.numel()
    what = ", ".join(counts) + f" of {total} scale{'s' if total != 1 else ''}"
    if bool((scale == 0).all()):
        what += " (all zero: the weight would dequantize to zeros)"
    first = int(bad.flatten().nonzero()[0])
    return what, first, float(scale.flatten()[first])


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 scale codes (uint8) -> float32 2^(code - 127); code 255 is NaN (OCP MX v1.0, section 5.4)."""
    exponent = codes.to(torch.int32) - 127
    out = torch.ldexp(torch.ones(codes.shape, dtype=torch.float32), exponent)
    return out.masked_fill(codes == 255, float("nan"))


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``[..., G, B]`` uint8 blocks (two E2M1 codes per byte, low nibble first) and ``[..., G]`` E8M0 scales
    -> float32 ``[..., G * 2B]``: element = E2M1 value x 2^(scale - 127)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # low nibble is the earlier element
    values = lut[codes].flatten(-2)  # [..., G, 2B]
    out = values * decode_e8m0(scales).unsqueeze(-1)  # power-of-two scaling: exact unless it over/underflows
    return out.flatten(-2)


# --------------------------------------------------------------------------- the checkpoint
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
                if path.suffix in _PICKLE_SUFFIXES:
                    raise UnsupportedWeightError(
                        f"{path}: pickle checkpoints are never opened (unpickling can run arbitrary code); "
                        + _CONVERT_HINT
                    )
                raise CheckpointError(
                    f"{path}: not a .safetensors file; give a model directory or one of its .safetensors files"
                )
            tensors, _ = parse_safetensors_header(path)
            config = path.parent / "config.json"
            if not config.exists() and path.is_symlink():  # a link to a model's file: the config is beside the file
                config = path.resolve().parent / "config.json"
            notes = _one_shard_note(path)
            ckpt = cls(path.parent, [path], tensors, _read_config(config), notes=notes, one_shard=bool(notes))
        else:
            root = path
            index_path = root / INDEX_FILE
            weight_map = read_weight_map(index_path) if index_path.exists() else None
            single, notes = _single_file_first(root, weight_map)
            if single is not None:
                tensors, _ = parse_safetensors_header(single)
                ckpt = cls(root, [single], tensors, _read_config(root / "config.json"), notes=notes)
                _refuse_packed(ckpt)
                return ckpt
            if weight_map is not None:
                files, tensors, notes = _open_sharded(root, index_path, weight_map)
            else:
                files = sorted(p for p in root.glob("*.safetensors"))
                if not files:
                    pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
                    if pickles:
                        raise UnsupportedWeightError(
                            f"{root}: only pickle weights found ({', '.join(pickles)}); plate-inspect reads "
                            f"safetensors only and never unpickles; " + _CONVERT_HINT
                        )
                    raise CheckpointError(
                        f"{root}: no .safetensors files found; give a Hugging Face model directory (model.safetensors, "
                        "or shards with model.safetensors.index.json), a .safetensors file, or a hub repo id"
                    )
                _refuse_missing_shards(root, files)
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
            ckpt = cls(root, files, tensors, _read_config(root / "config.json"), notes=notes)
        _refuse_packed(ckpt)
        return ckpt

    # ----------------------------------------------------------------- logical weights
    def logical_weights(self) -> dict[str, LogicalWeight]:
        """Every weight by its logical name, with logical (dequantized) shape and storage format.

        FP8 scales (``<name>_scale_inv``, ``<name>_scale``) and MXFP4 ``<name>_blocks``/``<name>_scales`` are
        folded into the weight they belong to and never appear on their own.
        """
        if self._logical is None:
            declared = isinstance(self.config.get("quantization_config"), dict)
            self._logical = _logical_weights(self.tensors, _fp8_block_size(self.config), declared)
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
        return _view(raw, dtype, info.shape), fingerprint_bytes(raw)

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
        return _view(raw, dtype, _sliced(info.shape, expert)), fingerprint_bytes(raw)

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
        return _broadcast_scale(scale, shape, weight.block)

    def mxfp4_scale(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The per-element dequantization scale 2^(e8m0 - 127) of MXFP4 weight ``name`` (expert ``expert``'s
        slice) in its logical shape: each 32-element block's scale repeated over it; a NaN code (255) gives NaN.
        Reads the scales only. Used by ``audit`` to round BASE to TUNED's MXFP4 grid (the twin of :meth:`fp8_scale`)."""
        weight = self._decodable(name, expert, "mxfp4")
        info = self.tensors[weight.parts[1]]
        codes = _view(self._read_slice(info, expert), torch.uint8, _sliced(info.shape, expert))
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
        values = (values.to(work) * _broadcast_scale(scale.to(work), shape, weight.block)).to(torch.float32)
        return values, fingerprint_parts([raw, scale_raw])

    def _read_mxfp4(self, weight: LogicalWeight, expert: int | None) -> tuple[torch.Tensor, str]:
        blocks_info, scales_info = (self.tensors[p] for p in weight.parts)
        blocks_raw = self._read_slice(blocks_info, expert)
        scales_raw = self._read_slice(scales_info, expert)
        blocks = _view(blocks_raw, torch.uint8, _sliced(blocks_info.shape, expert))
        scales = _view(scales_raw, torch.uint8, _sliced(scales_info.shape, expert))
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


def _view(raw: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


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


def _broadcast_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None) -> torch.Tensor:
    """A flat FP8 scale broadcast to the weight's shape: one scalar, or a grid of [br, bc] blocks (edges cut off)."""
    if block is None:
        return scale.reshape(())
    rows, cols = shape[-2:]
    grid = shape[:-2] + (-(-rows // block[0]), -(-cols // block[1]))
    return expand_block_scale(scale.reshape(grid), rows, cols, block)


def require_float_dtype(info: TensorInfo | LogicalWeight, dequantized: bool = True) -> torch.dtype:
    """The torch dtype a weight is read as, or a clear error for storage plate-inspect does not analyse.

    With ``dequantized`` (the default, for :meth:`Checkpoint.read_weight`), FP8 and MXFP4 storage reads as float32.
    """
    if info.dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[info.dtype]
    if dequantized and (info.dtype in FP8_DTYPES or info.dtype == "MXFP4"):
        return torch.float32
    kind = DTYPES[info.dtype].kind if info.dtype in DTYPES else "unknown"
    file = info.file.name if info.file else "?"
    raise UnsupportedWeightError(
        f"{file}: tensor '{info.name}' is stored as {info.dtype} ({kind}), which plate-inspect does not analyse "
        "(not supported: it reads bf16/fp16/fp32/fp64, and FP8 E4M3/E5M2 or MXFP4 with their scales); "
        + _DEQUANTIZE_HINT
    )


# --------------------------------------------------------------------------- quantized layouts
def _fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("weight_block_size") is None:
        return None
    block = quant["weight_block_size"]
    if not (isinstance(block, list) and len(block) == 2 and all(_is_index(b) and b > 0 for b in block)):
        raise CorruptCheckpointError(
            f"config.json: quantization_config.weight_block_size must be two positive integers, got {block!r:.80}"
        )
    return int(block[0]), int(block[1])


def _logical_weights(
    tensors: dict[str, TensorInfo], block: tuple[int, int] | None, declared: bool = False
) -> dict[str, LogicalWeight]:
    """Fold FP8 scales and MXFP4 blocks/scales into the weights they belong to; every other tensor stands alone.

    An FP8 tensor without a scale reads as its values (a plain cast, as fp8 diffusion checkpoints store them)
    unless the checkpoint is a scaled one (a quantization_config, or scales beside other FP8 tensors): there a
    missing scale is damage, and reading that weight raises instead of returning codes off by the scale.
    """
    scaled = declared or any(
        info.dtype in FP8_DTYPES and (name + "_scale_inv" in tensors or name + "_scale" in tensors)
        for name, info in tensors.items()
    )
    out: dict[str, LogicalWeight] = {}
    companions: set[str] = set()
    for name, info in tensors.items():
        base = name[: -len("_blocks")]
        scales = tensors.get(base + "_scales")
        # MXFP4 by its storage (U8 blocks) or its pairing (a *_scales beside it): malformed ones get a problem
        if name.endswith("_blocks") and len(info.shape) >= 3 and (info.dtype == "U8" or scales is not None):
            shape = info.shape[:-2] + (info.shape[-2] * info.shape[-1] * 2,)
            where = f"{info.file.name}: MXFP4 weight '{base}'"
            problem = ""
            if info.dtype != "U8":
                problem = f"{where}: '{name}' is stored as {info.dtype}; MXFP4 blocks are U8 (two E2M1 codes a byte)"
            elif scales is None:
                problem = f"{where}: no '{base}_scales' tensor beside '{name}'; the checkpoint is incomplete"
            elif scales.dtype not in ("U8", "F8_E8M0"):
                problem = f"{where}: '{scales.name}' is stored as {scales.dtype}; MXFP4 scales are U8 (E8M0)"
            elif scales.shape != info.shape[:-1]:
                problem = (
                    f"{where}: '{scales.name}' has shape {list(scales.shape)}, the blocks '{name}' need "
                    f"{list(info.shape[:-1])} (one scale per 32-value block)"
                )
            if problem:
                problem += "; re-download or re-convert the checkpoint"
            parts = (name,) if scales is None else (name, scales.name)
            out[base] = LogicalWeight(base, shape, "MXFP4", "mxfp4", parts, info.file, problem=problem)
            companions.update(parts)
    for name, info in tensors.items():
        if info.dtype not in FP8_DTYPES:  # FNUZ variants stay "other": refused on read
            continue
        scale = next((tensors[s] for s in (name + "_scale_inv", name + "_scale") if s in tensors), None)
        if scale is None:
            problem = ""
            if scaled:
                problem = (
                    f"{info.file.name}: FP8 tensor '{name}' has no scale tensor ('{name}_scale_inv' or "
                    f"'{name}_scale'): its codes cannot be dequantized; the checkpoint is incomplete (a shard or an "
                    "index entry missing?), re-download it"
                )
            out[name] = LogicalWeight(name, info.shape, info.dtype, "fp8", (name,), info.file, problem=problem)
            continue
        out[name] = _fp8_weight(info, scale, block)
        companions.add(scale.name)
    for name, info in tensors.items():
        if name in out or name in companions:
            continue
        fmt = "dense" if info.dtype in FLOAT_DTYPES else "other"
        out[name] = LogicalWeight(name, info.shape, info.dtype, fmt, (name,), info.file)
    return out


def _fp8_weight(info: TensorInfo, scale: TensorInfo, block: tuple[int, int] | None) -> LogicalWeight:
    """An FP8 weight with its scale: per tensor ([] / [1]), per expert ([E]), per row ([.., rows, 1]) or block grid."""
    where = f"{scale.file.name}: tensor '{scale.name}' (scale of '{info.name}')"
    if scale.dtype not in FP8_SCALE_DTYPES:
        raise UnsupportedWeightError(
            f"{where} is stored as {scale.dtype}; FP8 scales are F32/BF16/F16/F64 or F8_E8M0, so this is not a scale "
            "plate-inspect can apply: re-download the file, or " + _DEQUANTIZE_HINT
        )
    shape, s_shape = info.shape, scale.shape
    if len(shape) < 2:
        raise CorruptCheckpointError(f"{where}: the FP8 weight has shape {list(shape)}, scales need 2+ dims")
    lead, (rows, cols) = shape[:-2], shape[-2:]

    def with_block(block: tuple[int, int] | None) -> LogicalWeight:
        return LogicalWeight(info.name, shape, info.dtype, "fp8", (info.name, scale.name), info.file, block)

    if math.prod(s_shape) == 1:
        return with_block(None)  # one scale for the whole tensor
    rest = s_shape[len(lead) :]
    if s_shape[: len(lead)] == lead:
        if lead and math.prod(rest) == 1 and len(rest) <= 2:
            return with_block((rows, cols))  # one scale per expert
        if rest in ((rows,), (rows, 1)):
            return with_block((1, cols))  # one scale per output row
        if len(rest) == 2 and block is not None:
            expected = (-(-rows // block[0]), -(-cols // block[1]))
            if rest == expected:
                return with_block(block)
            raise CorruptCheckpointError(
                f"{where}: scale grid {list(s_shape)} does not match weight {list(shape)} with "
                f"quantization_config.weight_block_size {list(block)} (expected {list(lead + expected)}); use the "
                "config.json that came with the weights, or re-download this file"
            )
    hint = (
        "; re-download this file"
        if block is not None
        else "; block scales need quantization_config.weight_block_size in config.json (use the config.json that "
        "came with the weights)"
    )
    raise CorruptCheckpointError(f"{where}: scale shape {list(s_shape)} does not fit weight {list(shape)}{hint}")


def refuse_adapter(ckpt: Checkpoint, use: str = "scan") -> None:
    """A PEFT adapter (adapter_model*.safetensors only, or any LoRA tensor such as ``*.lora_A.weight``) is not a
    model to choose target modules in: its lora_A / lora_B matrices would be scanned as modules. Refused, naming the
    base model to ``use`` instead ("scan", "verify the bundle against") when the adapter names it. (Reading an
    adapter's tensors, as audit does, is fine: this is for target selection and weight checks.)"""
    root, files = ckpt.root, ckpt.files
    plate = next((n for n in sorted(ckpt.tensors) if n.endswith(".plate_A")), None)
    if plate is not None and not files[0].name.startswith("adapter_model"):  # a save_adapter file
        made_from = _plate_adapter_source(ckpt.tensors[plate].file)
        raise CheckpointError(
            f"{ckpt.tensors[plate].file}: a PLATE adapter (save_adapter: '{plate}'), not a model; {use} its base model"
            + (f" ({made_from}, as the adapter records it)" if made_from else "")
            + f", or merge the adapter into it first (plate-inspect merge BASE ADAPTER --out OUT) and {use} OUT"
        )
    lora = next((n for n in sorted(ckpt.tensors) if any(m in n for m in _LORA_MARKERS)), None)
    if lora is None and not (files and all(f.name.startswith("adapter_model") for f in files)):
        return
    adapter_config = root / "adapter_config.json"
    try:
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        base = None
    named = f" ({base}, as adapter_config.json names it)" if isinstance(base, str) and base else ""
    if files[0].name.startswith("adapter_model"):
        what = f"a PEFT adapter ({'adapter_config.json, ' if adapter_config.is_file() else ''}{files[0].name})"
    else:
        what = f"LoRA adapter tensors ('{lora}')"
    raise CheckpointError(
        f"{root}: holds {what}, not a model; {use} its base model{named}, or merge the adapter into it first (peft: "
        "PeftModel.from_pretrained(base, DIR).merge_and_unload().save_pretrained(OUT))"
    )


def _plate_adapter_source(path: Path) -> str | None:
    """The model a save_adapter file's bundle was scanned from (its metadata's ``source`` id), or None."""
    try:
        source = json.loads(parse_safetensors_header(path)[1].get("source", "null"))
    except (CheckpointError, ValueError, RecursionError):
        return None
    made_from = source.get("id") if isinstance(source, dict) else None
    return made_from if isinstance(made_from, str) and made_from else None


def _refuse_packed(ckpt: Checkpoint) -> None:
    """Packed integer formats (GPTQ, AWQ, bitsandbytes, EXL2, HQQ, AQLM, ...) are refused up front, naming the
    format (without this, a checkpoint whose layers hold only packed tensors read as one with no layer weights)."""
    for name in sorted(ckpt.tensors):
        integer = ckpt.tensors[name].dtype not in FLOAT_DTYPES
        for suffix, fmt in (_PACKED_SUFFIXES | _PACKED_INT_SUFFIXES if integer else _PACKED_SUFFIXES).items():
            if name.endswith(suffix):
                raise UnsupportedWeightError(
                    f"tensor '{name}' is a packed quantized weight ({fmt}), which plate-inspect does not read; "
                    + _DEQUANTIZE_HINT
                )


_SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<i>[0-9]+)-of-(?P<n>[0-9]+)\.safetensors")


def _refuse_missing_shards(root: Path, files: Iterable[Path]) -> None:
    """CheckpointError when shards are numbered (``model-00002-of-00004.safetensors``) and some of them are not in
    ``root``, which has no index to name its shards: reading the others would scan part of the model as if whole
    (an interrupted or partial download, a shard copied away). Names the missing files."""
    found: dict[tuple[str, int, str], set[int]] = {}
    for f in files:
        m = _SHARD_NAME.fullmatch(f.name)
        if m and 0 < int(m["i"]) <= int(m["n"]):
            found.setdefault((m["stem"], len(m["i"]), m["n"]), set()).add(int(m["i"]))
    missing = [
        f"{stem}-{i:0{width}d}-of-{n}.safetensors"
        for (stem, width, n), have in sorted(found.items())
        for i in range(1, int(n) + 1)
        if i not in have
    ]
    if missing:
        listed = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(
            f"{root}: shard{'s' if len(missing) > 1 else ''} {listed} missing (the shards are numbered, and there is "
            f"no {INDEX_FILE} to say which tensors they hold); re-download the checkpoint with its index, or give one "
            "shard's file to scan it alone"
        )


def _one_shard_note(path: Path) -> list[str]:
    """A note when ``path`` is one shard of the sharded checkpoint beside it: only its tensors are read."""
    index = path.parent / INDEX_FILE
    numbered = _SHARD_NAME.fullmatch(path.name)
    if not index.is_file() and numbered and int(numbered["n"]) > 1:  # no index: its name says it is one of n
        return [
            f"{path.name} is, by its name, shard {int(numbered['i'])} of {int(numbered['n'])} of a sharded checkpoint: "
            "only its tensors are scanned"
        ]
    try:
        shards = set(read_weight_map(index).values()) if index.is_file() else set()
    except CorruptCheckpointError:
        return []
    if path.name not in shards or len(shards) < 2:
        return []
    return [
        f"{path.name} is one of the {len(shards)} shards of the checkpoint in {path.parent} ({INDEX_FILE}): only its "
        f"tensors are scanned; give the directory to scan the whole model"
    ]


def single_file_is_read(has_single_file: bool, shards: Iterable[str] | None) -> bool:
    """Whether ``model.safetensors`` is what a directory is read from: present and not one of the index's
    ``shards`` (None: no index), as transformers' from_pretrained takes it before a sharded index. The one rule of
    the local reader, the hub download and the cache's completeness check."""
    return has_single_file and (shards is None or SINGLE_FILE not in set(shards))


def _single_file_first(root: Path, weight_map: dict[str, str] | None) -> tuple[Path | None, list[str]]:
    """``root/model.safetensors`` when it exists and is not one of the index's shards, as transformers'
    from_pretrained takes it before a sharded index (so the scan reads the weights the model loads), with a note
    naming the files left aside; else (None, [])."""
    single = root / SINGLE_FILE
    if not single_file_is_read(single.is_file(), None if weight_map is None else weight_map.values()):
        return None, []
    others = sorted(p.name for p in root.glob("*.safetensors") if p.name != SINGLE_FILE)
    if (root / INDEX_FILE).exists():
        others.insert(0, INDEX_FILE)
    if not others:
        return single, []
    listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    return single, [
        f"{root} holds {SINGLE_FILE} and other weights ({listed}); reading {SINGLE_FILE} only, the file transformers "
        f"loads from this directory (to scan the others, move {SINGLE_FILE} away)"
    ]


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: cannot parse config.json: {e}; re-download it") from None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{path}: config.json is not a JSON object; re-download it")
    quant = config.get("quantization_config")
    if quant:
        _check_quantization(path, quant)
    return config


def _check_quantization(path: Path, quant: Any) -> None:
    """Refuse a quantization_config whose storage plate-inspect cannot dequantize, naming the method and format."""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not isinstance(method, str):
        raise UnsupportedWeightError(
            f"{path}: quantization_config has no quant_method, so the storage is unknown; plate-inspect reads "
            "FP8 with scales (fp8, fbgemm_fp8, compressed-tensors float-quantized) and MXFP4; " + _DEQUANTIZE_HINT
        )
    if method == COMPRESSED_TENSORS:
        fmt = quant.get("format")
        if fmt in COMPRESSED_TENSORS_FORMATS:
            return
        raise UnsupportedWeightError(
            f"{path}: the checkpoint is compressed-tensors with format {fmt!r}, which plate-inspect does not read "
            f"(it reads the formats {', '.join(sorted(COMPRESSED_TENSORS_FORMATS))}: FP8 or unquantized "
            "weights stored as they are); " + _DEQUANTIZE_HINT
        )
    if method not in SUPPORTED_QUANT_METHODS:
        raise UnsupportedWeightError(
            f"{path}: the checkpoint is quantized with '{method}', which plate-inspect does not read (it reads FP8 "
            "with scales: fp8, fbgemm_fp8, compressed-tensors float-quantized; and MXFP4); " + _DEQUANTIZE_HINT
        )


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file name), validated."""
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{index_path}: corrupt index ({type(e).__name__}: {e}); re-download it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CorruptCheckpointError(
            f"{index_path}: corrupt index (weight_map must map tensor names to file names); re-download it"
        )
    return weight_map


def _open_sharded(
    root: Path, index_path: Path, weight_map: dict[str, str]
) -> tuple[list[Path], dict[str, TensorInfo], list[str]]:
    """The shards an index names (inside ``root``, present, headers valid), each listed tensor's place, and notes.

    A tensor a shard holds that the index does not list is read too, as transformers loads every tensor of the
    shards (a hand-edited or stale index): left out, its module dropped out of the scan without a word."""
    root_norm = os.path.normpath(root)
    shard_names = sorted(set(weight_map.values()))
    files: list[Path] = []
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in shard_names:
        # lexical check: hub snapshots are symlinks into a blob store, so resolving them would always "escape"
        shard_norm = os.path.normpath(os.path.join(root_norm, shard))
        if os.path.isabs(shard) or not shard_norm.startswith(root_norm + os.sep):
            raise CheckpointError(f"{index_path}: shard '{shard}' points outside the model directory; refusing")
        shard_path = Path(shard_norm)
        if not shard_path.is_file():
            link = dangling_link(shard_path)
            raise CheckpointError(
                f"{index_path}: names shard '{shard}', which is missing; "
                + (link.replace("it is a", f"{shard} is a", 1) if link else "re-download it")
            )
        files.append(shard_path)
        headers[shard], _ = parse_safetensors_header(shard_path)
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        info = headers[shard].get(name)
        if info is None:
            raise CheckpointError(
                f"{index_path}: lists tensor '{name}' in '{shard}', but that shard lacks it; the index and its shards "
                "come from different versions: re-download both"
            )
        tensors[name] = info
    unlisted: dict[str, TensorInfo] = {}
    for shard in shard_names:  # a second, different copy in another shard: which one a loader takes is unclear
        for name, other in headers[shard].items():
            listed = tensors.get(name, unlisted.get(name))
            if listed is None:
                unlisted[name] = other
            elif listed.file != other.file and not _same_stored(listed, other):
                said = "(as the index says) " if name in tensors else ""
                raise CorruptCheckpointError(
                    f"{index_path}: tensor '{name}' is in '{listed.file.name}' {said}and, with other "
                    f"values, in '{shard}'; the shards come from different saves: re-download the checkpoint"
                )
    notes = []
    if unlisted:
        first = min(unlisted)
        notes.append(
            f"{INDEX_FILE} does not list {len(unlisted)} tensor{'s' if len(unlisted) > 1 else ''} its shards hold "
            f"('{first}' in {unlisted[first].file.name}{', ...' if len(unlisted) > 1 else ''}); they are read too, "
            "as transformers loads every tensor of the shards (the index is stale or was edited?)"
        )
    return files, {**tensors, **unlisted}, notes


def _same_stored(a: TensorInfo, b: TensorInfo) -> bool:
    """Whether two stored tensors hold the same dtype, shape and bytes (read in 64 MiB blocks)."""
    if (a.dtype, a.shape, a.nbytes) != (b.dtype, b.shape, b.nbytes):
        return False
    block = 64 << 20
    try:
        with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
            for offset in range(0, a.nbytes, block):
                n = min(block, a.nbytes - offset)
                fa.seek(a.start + offset)
                fb.seek(b.start + offset)
                if fa.read(n) != fb.read(n):
                    return False
    except OSError as e:
        raise CheckpointError(
            f"{a.file}: cannot read tensor '{a.name}': {e.strerror or e}; {os_error_advice(e)}"
        ) from None
    return True


def __getattr__(name: str) -> object:
    """The hub's names at their earlier place (``plate_inspect.checkpoint.resolve_hub_snapshot``): now in
    :mod:`plate_inspect.hub`, which imports this module."""
    if name in ("resolve_hub_snapshot", "hub_weight_files"):
        from plate_inspect import hub

        return getattr(hub, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
