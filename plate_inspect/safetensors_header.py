"""Parse and validate a safetensors file's header as strictly as safetensors itself does (no tensor data read).

Each entry becomes a :class:`TensorInfo`: name, dtype, shape and the absolute byte range of its data in the file.
The checks and their messages are the reader's first line of defence against truncated, damaged or hand-made files.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plate_inspect.arguments import path_argument
from plate_inspect.dtypes import DTYPES
from plate_inspect.errors import CheckpointError, CorruptCheckpointError, os_error_advice

__all__ = ["TensorInfo", "is_index", "parse_safetensors_header"]

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_MAX_INDEX = 1 << 64  # offsets, dims and sizes beyond u64 cannot describe a real file


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


def is_index(value: Any) -> bool:
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
    if not isinstance(shape, list) or not all(is_index(d) for d in shape):
        raise _corrupt(path, f"{where}: shape must be a list of non-negative integers, got {shape!r:.100}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_index(o) for o in offsets):
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
