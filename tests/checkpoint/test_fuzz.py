"""Fuzz the checkpoint reader: any mutation of a valid checkpoint reads, or raises the project's own error.

No other exception type may escape the public API (Checkpoint.open / read / read_weight / scan), whatever the
bytes: flipped bits, header fields replaced with values of the wrong type, truncation, extension.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plate_inspect.checkpoint import Checkpoint
from plate_inspect.dtypes import DTYPES
from plate_inspect.errors import PlateInspectError
from plate_inspect.testing.quantized import fp8_tensors, mxfp4_tensors, write_safetensors

FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


def _valid_checkpoint() -> tuple[bytes, dict]:
    """A small valid file mixing dense, FP8 block-scaled and MXFP4 expert weights, and its config."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 4, 1, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (2, 4, 1), generator=gen, dtype=torch.uint8)
    tensors = {
        "a.weight": torch.randn(8, 6, generator=gen).to(torch.bfloat16),
        "a.bias": torch.randn(8, generator=gen),
        **fp8_tensors({"b.weight": torch.randn(8, 8, generator=gen)}, block=(4, 4)),
        **mxfp4_tensors("experts.w", blocks, scales),
    }
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 4]}}
    with tempfile.TemporaryDirectory() as d:
        path = write_safetensors(d, tensors)
        return (path / "model.safetensors").read_bytes(), config


VALID, CONFIG = _valid_checkpoint()
_HEADER_LEN = struct.unpack("<Q", VALID[:8])[0]
HEADER = json.loads(VALID[8 : 8 + _HEADER_LEN])
TENSORS = sorted(k for k in HEADER if k != "__metadata__")
DATA = VALID[8 + _HEADER_LEN :]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def exercise(directory: Path, scan_out: Path | None = None) -> None:
    """Everything a user can do with a checkpoint; any exception must be a PlateInspectError with a message."""
    try:
        ckpt = Checkpoint.open(directory)
        for name in list(ckpt.tensors):
            try:
                ckpt.read(name)
            except PlateInspectError as e:
                assert str(e)
        for name, weight in ckpt.logical_weights().items():
            try:
                ckpt.read_weight(name)
                if len(weight.shape) >= 3 and weight.shape[0] > 0:
                    ckpt.read_weight(name, expert=weight.shape[0] - 1)
            except PlateInspectError as e:
                assert str(e)
        if scan_out is not None:
            from plate_inspect.scanner import scan

            scan(directory, scan_out, r=2, max_rank=8, target_modules=["a", "b"], overwrite=True)
    except PlateInspectError as e:
        assert str(e) and "\n" not in str(e).strip()


def write_case(directory: Path, data: bytes, config: object = CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(data)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def with_header(header: object, data: bytes = DATA) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_the_unmutated_file_reads_and_scans(tmp_path):
    d = write_case(tmp_path / "m", VALID)
    ckpt = Checkpoint.open(d)
    assert set(ckpt.logical_weights()) == {"a.weight", "a.bias", "b.weight", "experts.w"}
    exercise(d, tmp_path / "out")
    assert (tmp_path / "out" / "manifest.json").exists()


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=6))
def test_flipped_bytes(flips):
    data = bytearray(VALID)
    for pos, mask in flips:
        data[pos] ^= mask
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d), bytes(data)))


@FUZZ
@given(cut=st.integers(0, len(VALID) - 1), extra=st.binary(max_size=64), extend=st.booleans())
def test_truncated_or_extended(cut, extra, extend):
    data = VALID + extra if extend else VALID[:cut]
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d), data))


@FUZZ
@given(
    tensor=st.sampled_from(TENSORS),
    key=st.sampled_from(["dtype", "shape", "data_offsets", "extra"]),
    value=json_values | st.sampled_from(sorted(DTYPES)) | st.lists(st.integers(-3, 300), max_size=4),
    delete=st.booleans(),
)
def test_header_field_replaced_with_any_json(tensor, key, value, delete):
    header = json.loads(json.dumps(HEADER))
    if delete:
        header[tensor].pop(key, None)
    else:
        header[tensor][key] = value
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d), with_header(header)))


@FUZZ
@given(tensor=st.sampled_from(TENSORS), value=json_values, metadata=json_values)
def test_header_entry_or_metadata_replaced(tensor, value, metadata):
    header = json.loads(json.dumps(HEADER))
    header[tensor] = value
    header["__metadata__"] = metadata
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d), with_header(header)))
        exercise(write_case(Path(d), with_header(value)))


@FUZZ
@given(path=st.sampled_from(["quantization_config", "weight_block_size", "quant_method"]), value=json_values)
def test_config_quantization_fields_of_any_type(path, value):
    config = json.loads(json.dumps(CONFIG))
    if path == "quantization_config":
        config[path] = value
    else:
        config["quantization_config"][path] = value
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d), VALID, config))


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    tensor=st.sampled_from(["a.weight", "b.weight", "b.weight_scale_inv"]),
    shape=st.lists(st.integers(0, 9), max_size=3),
    dtype=st.sampled_from(["BF16", "F32", "F8_E4M3", "F8_E5M2", "U8", "F4", "F16"]),
)
def test_consistent_but_unexpected_layouts_scan_or_fail_cleanly(tensor, shape, dtype):
    """Headers that stay self-consistent (offsets recomputed) with other shapes/dtypes: the scan copes or refuses."""
    header = json.loads(json.dumps(HEADER))
    header[tensor]["shape"], header[tensor]["dtype"] = shape, dtype
    offset, chunks, source = 0, [], json.loads(json.dumps(HEADER))
    for name in sorted(TENSORS, key=lambda n: source[n]["data_offsets"][0]):
        bits = DTYPES[header[name]["dtype"]].bits
        for d in header[name]["shape"]:
            bits *= d
        size = -(-bits // 8)
        begin = source[name]["data_offsets"][0]
        chunk = DATA[begin : begin + size].ljust(size, b"\x01")
        header[name]["data_offsets"] = [offset, offset + size]
        chunks.append(chunk)
        offset += size
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d) / "m", with_header(header, b"".join(chunks))), Path(d) / "out")


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(flips=st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(1, 255)), min_size=1, max_size=8))
def test_flipped_data_bytes_scan_or_fail_cleanly(flips):
    """Valid headers over damaged values (NaN, inf, huge scales): the scan finishes or names the tensor."""
    data = bytearray(VALID)
    for pos, mask in flips:
        data[8 + _HEADER_LEN + pos] ^= mask
    with tempfile.TemporaryDirectory() as d:
        exercise(write_case(Path(d) / "m", bytes(data)), Path(d) / "out")
