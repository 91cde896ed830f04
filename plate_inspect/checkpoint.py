"""Read safetensors checkpoints lazily: resolve a source, parse shard headers, read one tensor's bytes at a time.

Nothing here loads a model. A :class:`Checkpoint` knows every tensor's file, dtype, shape and byte range from
the shard headers alone; :meth:`Checkpoint.read` reads exactly one tensor's stored bytes. Pickle files
(``.bin``/``.pt``) are never opened.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plate_inspect.errors import CheckpointError, UnsupportedWeightError

#: safetensors dtype names plate-inspect analyses, with their torch dtypes.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
_ITEM_SIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "F6_E2M3": 1,
    "F6_E3M2": 1,
    "C64": 8,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_CONVERT_HINT = (
    "convert it once with transformers: AutoModel.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)"
)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live, from the shard header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SourceRef:
    """What was scanned: a hub repo (id + revision + resolved commit) or a local path."""

    kind: str  # "hub" | "local"
    id: str
    revision: str | None = None
    commit: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "revision": self.revision, "commit": self.commit}


def parse_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; detects truncation and inconsistent offsets."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is truncated ({size} bytes): not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (header length {n}, file size {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (invalid JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries: dict[str, TensorInfo] = {}
    for name, spec in header.items():
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(int(s) for s in spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from None
        expected = math.prod(shape) * _ITEM_SIZE.get(dtype, 1)
        if dtype in _ITEM_SIZE and end - begin != expected:
            raise CheckpointError(
                f"{path}: tensor '{name}' has {end - begin} bytes but {dtype}{list(shape)} needs {expected}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: file is truncated: tensor '{name}' ends at byte {data_start + end} but the file "
                f"has {size} bytes; re-download this shard"
            )
        entries[name] = TensorInfo(name, dtype, shape, path, data_start + begin, data_start + end)
    return entries, metadata


def fingerprint_bytes(data: bytes | bytearray | memoryview) -> str:
    """Identity of a weight: sha256 of its stored bytes (dtype and layout as in the checkpoint)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fingerprint_tensor(tensor: torch.Tensor) -> str:
    """The same fingerprint, computed from an in-memory tensor (e.g. a loaded model's parameter)."""
    t = tensor.detach().to("cpu").contiguous()
    return fingerprint_bytes(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


@dataclass
class Checkpoint:
    """A safetensors checkpoint opened lazily: headers parsed, no tensor data read yet."""

    root: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    config: dict[str, Any] = field(default_factory=dict)
    source: SourceRef | None = None
    bytes_read: int = 0

    # ----------------------------------------------------------------- construction
    @classmethod
    def open(cls, source: str | os.PathLike, revision: str | None = None, offline: bool | None = None) -> Checkpoint:
        """Open a local dir, a single ``.safetensors`` file, or a Hugging Face repo id (cache first)."""
        path = Path(source).expanduser()
        if path.exists():
            ckpt = cls._open_local(path)
            ckpt.source = SourceRef("local", str(path.resolve()))
            return ckpt
        if _looks_like_repo_id(str(source)):
            root, commit = resolve_hub_snapshot(str(source), revision=revision, offline=offline)
            ckpt = cls._open_local(root)
            ckpt.source = SourceRef("hub", str(source), revision or "main", commit)
            return ckpt
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
                raise CheckpointError(f"{path}: not a .safetensors file")
            tensors, _ = parse_safetensors_header(path)
            config = _read_config(path.parent / "config.json")
            return cls(path.parent, [path], tensors, config)
        root = path
        index_path = root / "model.safetensors.index.json"
        if index_path.exists():
            files, tensors = _open_sharded(root, index_path)
        else:
            files = sorted(p for p in root.glob("*.safetensors"))
            if not files:
                pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
                if pickles:
                    raise UnsupportedWeightError(
                        f"{root}: only pickle weights found ({', '.join(pickles)}); plate-inspect reads "
                        f"safetensors only and never unpickles; " + _CONVERT_HINT
                    )
                raise CheckpointError(f"{root}: no .safetensors files found")
            tensors = {}
            for f in files:
                entries, _ = parse_safetensors_header(f)
                tensors.update(entries)
        return cls(root, files, tensors, _read_config(root / "config.json"))

    # ----------------------------------------------------------------- reading
    def read_bytes(self, name: str) -> bytearray:
        """Read one tensor's stored bytes (exactly its byte range, nothing else)."""
        info = self.tensors[name]
        buf = bytearray(info.nbytes)
        try:
            with open(info.file, "rb") as f:
                f.seek(info.start)
                got = f.readinto(buf)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot read tensor '{name}': {e.strerror or e}") from None
        if got != info.nbytes:
            raise CheckpointError(f"{info.file}: file is truncated while reading tensor '{name}'")
        self.bytes_read += info.nbytes
        return buf

    def read(self, name: str) -> tuple[torch.Tensor, str]:
        """One tensor in its stored dtype (a view of freshly read bytes) and its fingerprint."""
        info = self.tensors[name]
        dtype = require_float_dtype(info)
        raw = self.read_bytes(name)
        fingerprint = fingerprint_bytes(raw)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype), fingerprint
        return torch.frombuffer(raw, dtype=dtype).reshape(info.shape), fingerprint

    def read_weight(self, name: str) -> tuple[torch.Tensor, str]:
        """A weight as a floating tensor of its logical shape, and the fingerprint of the bytes it came from.

        The one read path of the scanner: quantized storage (FP8 with scales, MXFP4 blocks) dequantizes here.
        """
        return self.read(name)

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


def require_float_dtype(info: TensorInfo) -> torch.dtype:
    """The torch dtype of a floating weight, or a clear error for quantized/integer/fp8 storage."""
    if info.dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[info.dtype]
    kind = "fp8" if info.dtype.startswith("F8") else "integer/quantized"
    raise UnsupportedWeightError(
        f"{info.file.name}: tensor '{info.name}' is stored as {info.dtype} ({kind}), which is not supported: "
        "plate-inspect analyses bf16/fp16/fp32/fp64 weights; dequantize the checkpoint to bf16 first"
    )


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse config.json: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json is not a JSON object")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise UnsupportedWeightError(
            f"{path}: the checkpoint is quantized ({method}); plate-inspect analyses bf16/fp16/fp32 weights: "
            "scan the unquantized base model instead"
        )
    return config


def _open_sharded(root: Path, index_path: Path) -> tuple[list[Path], dict[str, TensorInfo]]:
    try:
        index = json.loads(index_path.read_text())
        weight_map: dict[str, str] = index["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: corrupt index ({e})") from None
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
        if not shard_path.exists():
            raise CheckpointError(f"{index_path}: names shard '{shard}', which is missing; re-download it")
        files.append(shard_path)
        headers[shard], _ = parse_safetensors_header(shard_path)
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        info = headers[shard].get(name)
        if info is None:
            raise CheckpointError(f"{index_path}: lists tensor '{name}' in '{shard}', but that shard lacks it")
        tensors[name] = info
    return files, tensors


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))


def resolve_hub_snapshot(repo_id: str, revision: str | None = None, offline: bool | None = None) -> tuple[Path, str]:
    """Local snapshot dir of a hub repo: the HF cache first; download ``*.safetensors`` + ``*.json`` if allowed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.safetensors", "*.json"]
    fetch_hint = f"fetch them on a connected machine with: hf download {repo_id} --include '*.safetensors' '*.json'" + (
        f" --revision {revision}" if revision else ""
    )
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        path = None
    if path is not None and _snapshot_complete(Path(path)):
        return Path(path), Path(path).name
    if offline if offline is not None else HF_HUB_OFFLINE:
        missing = _missing_files(Path(path)) if path else ["the whole repo"]
        raise CheckpointError(
            f"{repo_id}: not fully in the local Hugging Face cache ({HF_HUB_CACHE}; missing: "
            f"{', '.join(missing)}) and offline mode is on; {fetch_hint}"
        )
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except Exception as e:  # network errors come in many types; the message is what matters
        missing = _missing_files(Path(path)) if path else ["the whole repo"]
        raise CheckpointError(
            f"{repo_id}: not in the local Hugging Face cache ({HF_HUB_CACHE}; missing: {', '.join(missing)}) "
            f"and the hub cannot be reached ({type(e).__name__}); {fetch_hint}"
        ) from None
    return Path(path), Path(path).name


def _snapshot_complete(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors")) and not _missing_files(path)


def _missing_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return [] if any(path.glob("*.safetensors")) else ["*.safetensors"]
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, json.JSONDecodeError, KeyError):
        return ["model.safetensors.index.json (corrupt)"]
    return sorted(s for s in shards if not (path / s).exists())
