"""Header validation as strict as safetensors' own: safetensors (the Rust reader) is the oracle for valid/invalid;
the error classes, and read_weight's messages."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from plate_inspect.checkpoint import Checkpoint, parse_safetensors_header
from plate_inspect.dtypes import DTYPES, FLOAT_DTYPES, PRECISIONS, Q_DTYPES, safetensors_name, torch_dtype
from plate_inspect.errors import CheckpointError, CorruptCheckpointError, PlateInspectError, UnsupportedWeightError
from plate_inspect.testing.synthetic import write_llama_like


def raw_file(header: dict | bytes, data: bytes = b"") -> bytes:
    """A safetensors file from a header (dict or raw JSON bytes) and a data section, no validation."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def safetensors_accepts(path: Path) -> bool:
    """The oracle: does the safetensors library itself open this file and describe every tensor?"""
    try:
        with safetensors.safe_open(str(path), "numpy") as f:
            names = f.keys()
            for key in names:
                f.get_slice(key).get_shape()
        return True
    except Exception:  # noqa: BLE001 - any refusal counts
        return False


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# --------------------------------------------------------------------------- the dtype table
def test_dtype_table_bits_match_torch_element_sizes():
    for name, d in DTYPES.items():
        if d.torch is not None:
            assert d.bits == torch.empty((), dtype=d.torch).element_size() * 8, name
            assert torch_dtype(name) is d.torch and safetensors_name(d.torch) == name
    assert DTYPES["F4"].bits == 4 and DTYPES["F6_E2M3"].bits == 6 and DTYPES["F6_E3M2"].bits == 6
    assert set(FLOAT_DTYPES) == {"F64", "F32", "F16", "BF16"}
    assert dict(Q_DTYPES) == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert dict(PRECISIONS) == {"float32": torch.float32, "float64": torch.float64}


def test_the_other_modules_use_the_one_table():
    import plate_inspect.bundle as bundle
    import plate_inspect.checkpoint as checkpoint
    import plate_inspect.dtypes as dtypes
    import plate_inspect.scanner as scanner
    import plate_inspect.train.weightcheck as weightcheck

    assert bundle.Q_DTYPES is dtypes.Q_DTYPES and scanner.Q_DTYPES is dtypes.Q_DTYPES
    assert scanner.PRECISIONS is dtypes.PRECISIONS
    assert checkpoint.FLOAT_DTYPES is dtypes.FLOAT_DTYPES and weightcheck.FLOAT_DTYPES is dtypes.FLOAT_DTYPES


# --------------------------------------------------------------------------- valid files are never called corrupt
# every dtype safetensors writes that this torch has (torch 2.2 has no uint16/32/64 and no float8_e8m0fnu)
_WRITABLE = [
    getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "int16",
        "uint16",
        "float16",
        "bfloat16",
        "int32",
        "uint32",
        "float32",
        "complex64",
        "float64",
        "int64",
        "uint64",
    )
    if hasattr(torch, name)
]


def test_every_dtype_written_by_safetensors_parses(tmp_path):
    tensors = {f"t{i}": torch.zeros(3, 5, dtype=dt) for i, dt in enumerate(_WRITABLE)}
    tensors["fp4"] = torch.zeros(3, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)  # header: F4 [3, 8]
    tensors["empty"] = torch.zeros(0, 7, dtype=torch.float32)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    entries, _ = parse_safetensors_header(path)
    with safetensors.safe_open(str(path), "numpy") as f:
        names = f.keys()
        for name in names:
            assert list(entries[name].shape) == f.get_slice(name).get_shape()
            assert entries[name].dtype == f.get_slice(name).get_dtype()
    assert entries["fp4"].dtype == "F4" and entries["fp4"].shape == (3, 8) and entries["fp4"].nbytes == 12
    assert entries["t15"].dtype == "C64" and entries["t15"].nbytes == 15 * 8


@pytest.mark.parametrize(
    "dtype, shape, nbytes",
    [("F6_E2M3", [4], 3), ("F6_E3M2", [2, 4], 6), ("F4", [6], 3), ("F8_E8M0", [5], 5), ("C64", [2], 16)],
)
def test_sub_byte_and_rare_dtypes_sized_in_bits(tmp_path, dtype, shape, nbytes):
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw_file({"x": entry(dtype, shape, 0, nbytes)}, b"\0" * nbytes))
    assert safetensors_accepts(path)
    entries, _ = parse_safetensors_header(path)
    assert entries["x"].nbytes == nbytes


def test_padded_header_and_metadata_accepted(tmp_path):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"__metadata__": {"format": "pt"}, "a": entry("F32", [2], 0, 8)}).encode() + b"      "
    path.write_bytes(raw_file(header, b"\0" * 8))
    assert safetensors_accepts(path)
    entries, meta = parse_safetensors_header(path)
    assert meta == {"format": "pt"} and entries["a"].shape == (2,)


# --------------------------------------------------------------------------- invalid headers: what safetensors refuses
_TWO = {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 4, 8)}
_INVALID = {
    "string offset": ({"a": entry("F32", [1], "0", 4)}, 4, "a"),
    "null dtype": ({"a": entry(None, [1], 0, 4)}, 4, "a"),
    "unknown dtype": ({"a": entry("F12", [1], 0, 4)}, 4, "a"),
    "string shape": ({"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, 4, "a"),
    "float dim": ({"a": entry("F32", [1.0], 0, 4)}, 4, "a"),
    "negative dim": ({"a": entry("F32", [-1], 0, 4)}, 4, "a"),
    "null shape": ({"a": {"dtype": "F32", "shape": None, "data_offsets": [0, 4]}}, 4, "a"),
    "three offsets": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, 4, "a"),
    "missing offsets": ({"a": {"dtype": "F32", "shape": [1]}}, 4, "a"),
    "entry not an object": ({"a": [1, 2]}, 4, "a"),
    "end before begin": ({"a": entry("F32", [0], 4, 0)}, 4, "a"),
    "size mismatch": ({"a": entry("F32", [2], 0, 4)}, 4, "a"),
    "F4 odd count": ({"a": entry("F4", [3], 0, 2)}, 2, "a"),
    "overlap": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 2, 6)}, 6, "b"),
    "gap": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, 12, "b"),
    "not from zero": ({"a": entry("F32", [1], 4, 8)}, 8, "a"),
    "trailing bytes": (_TWO, 9, "after the last"),
    "huge dims": ({"a": entry("F32", [2**40, 2**40], 0, 4)}, 4, "a"),
    "metadata not strings": ({"__metadata__": {"k": 1}, **_TWO}, 8, "__metadata__"),
    "not an object": ([1, 2], 0, "does not start with"),
}


@pytest.mark.parametrize("case", sorted(_INVALID))
def test_invalid_header_refused_like_safetensors(tmp_path, case):
    header, n_data, needle = _INVALID[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_file(json.dumps(header).encode(), b"\0" * n_data))
    assert not safetensors_accepts(path), f"oracle accepts {case}"
    with pytest.raises(CorruptCheckpointError) as info:
        parse_safetensors_header(path)
    message = str(info.value)
    assert "bad.safetensors" in message and needle in message and "\n" not in message


def test_overlapping_tensors_named(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_file({"first": entry("F32", [2], 0, 8), "second": entry("F32", [1], 4, 8)}, b"\0" * 8))
    with pytest.raises(CorruptCheckpointError, match="'second' overlaps tensor 'first'"):
        parse_safetensors_header(path)


def test_duplicate_tensor_name_refused(tmp_path):
    path = tmp_path / "dup.safetensors"
    one = '"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    path.write_bytes(raw_file(("{" + one + ", " + one + "}").encode(), b"\0" * 4))
    with pytest.raises(CorruptCheckpointError, match="'a' appears twice"):
        parse_safetensors_header(path)


def test_truncated_data_says_truncated(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(raw_file({"w": entry("BF16", [4, 4], 0, 32)}, b"\0" * 20))
    assert not safetensors_accepts(path)
    with pytest.raises(CorruptCheckpointError, match="truncated.*'w'"):
        parse_safetensors_header(path)


def test_header_not_starting_with_brace(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw_file(b' {"a": 1}', b""))
    assert not safetensors_accepts(path)
    with pytest.raises(CorruptCheckpointError, match="does not start with"):
        parse_safetensors_header(path)


# --------------------------------------------------------------------------- checkpoint-level input errors
def test_index_with_wrong_types_is_a_checkpoint_error(tmp_path):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    for weight_map in ([1, 2], {"w": ["model.safetensors"]}, {"w": None}, "x"):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CorruptCheckpointError, match="index"):
            Checkpoint.open(tmp_path)


def test_config_not_an_object_or_bad_json(tmp_path):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    for text in ("[1]", "{not json", "\udcff"):
        (tmp_path / "config.json").write_text(text, errors="surrogateescape")
        with pytest.raises(CorruptCheckpointError, match="config.json"):
            Checkpoint.open(tmp_path)


def test_same_tensor_in_two_unindexed_files_refused(tmp_path):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="'w' is also in a.safetensors"):
        Checkpoint.open(tmp_path)


def test_reading_unknown_or_integer_tensors_raises_project_errors(tmp_path):
    save_file(
        {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "i": torch.zeros(3, dtype=torch.int8)},
        str(tmp_path / "model.safetensors"),
    )
    ckpt = Checkpoint.open(tmp_path)
    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        ckpt.read("nope")
    with pytest.raises(CheckpointError, match="no weight named 'nope'"):
        ckpt.read_weight("nope")
    with pytest.raises(UnsupportedWeightError, match="'i' is stored as I8"):
        ckpt.read_weight("i")
    w, _ = ckpt.read_weight("w")
    assert torch.equal(w, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    with pytest.raises(CheckpointError, match="expert slices need"):
        ckpt.read_weight("w", expert=0)


def test_packed_formats_refused_naming_the_format(tmp_path):
    for names, fmt in (
        (("l.qweight", "l.qzeros", "l.scales"), "GPTQ/AWQ"),
        (("l.weight", "l.weight.absmax", "l.weight.quant_map"), "bitsandbytes 4-bit"),
        (("l.weight", "l.SCB"), "bitsandbytes 8-bit"),
    ):
        d = tmp_path / fmt.replace("/", "_").replace(" ", "_")
        d.mkdir()
        save_file({n: torch.zeros(4, dtype=torch.uint8) for n in names}, str(d / "model.safetensors"))
        with pytest.raises(UnsupportedWeightError, match=fmt) as info:
            Checkpoint.open(d)
        assert "unquantized base model" in str(info.value)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "hqq"])
def test_packed_quant_methods_in_config_refused(tmp_path, method):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": method}}))
    with pytest.raises(UnsupportedWeightError, match=f"'{method}'"):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({"quant_method": "compressed-tensors"}, "format None"),
        ({"bits": 4}, "no quant_method"),
    ],
)
def test_unreadable_compressed_tensors_formats_and_unnamed_methods_refused(tmp_path, quant, message):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(UnsupportedWeightError, match=message) as info:
        Checkpoint.open(tmp_path)
    assert "packed integer" not in str(info.value)


def test_errors_form_one_hierarchy():
    from plate_inspect import errors
    from plate_inspect.analysis import alignment, curvature
    from plate_inspect.reports import ReportError
    from plate_inspect.reports.browser import BrowserError

    assert alignment.AlignmentError is errors.AlignmentError and curvature.CurvatureError is errors.CurvatureError
    assert ReportError is errors.ReportError and BrowserError is errors.BrowserError
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert all(issubclass(c, PlateInspectError) for c in classes)
    assert issubclass(errors.HubGatedRepoError, errors.HubError) and issubclass(errors.HubError, CheckpointError)


def test_no_error_class_defined_outside_errors_module():
    import re

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"^class \w+(Error|Exception)\b", re.M)
    offenders = [
        str(p.relative_to(root))
        for folder in ("plate_inspect", "cli", "reports")
        for p in (root / folder).rglob("*.py")
        if p.name != "errors.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_a_symlink_to_a_models_file_finds_the_models_config(gpt2_ckpt, tmp_path):
    """QA: a link elsewhere to GPT-2's model.safetensors lost config.json (no model_type: Conv1D weights read as
    [out, in], B and Q transposed). The config beside the linked file is used when none is beside the link."""
    from plate_inspect.targets import select_targets

    link = tmp_path / "links" / "gpt2.safetensors"
    link.parent.mkdir()
    link.symlink_to(gpt2_ckpt.path / "model.safetensors")
    direct = Checkpoint.open(gpt2_ckpt.path / "model.safetensors")
    linked = Checkpoint.open(link)
    assert linked.config == direct.config and linked.config["model_type"] == "gpt2"
    assert [(t.name, t.layout, t.shape) for t in select_targets(linked)[0]] == [
        (t.name, t.layout, t.shape) for t in select_targets(direct)[0]
    ]
    assert all(t.layout == "conv1d" for t in select_targets(linked)[0])


def test_read_weight_of_a_module_name_names_its_weight(tmp_path):
    """QA: the README's API reads weights by name (`read_weight('model.layers.0.self_attn.q_proj.weight')`), while
    bundles name modules without `.weight`; `ckpt.read_weight(bundle.modules[0])` said only "has no weight named
    ...". It now names the weight to read, and reading that one gives the stored tensor (safetensors' own loader)."""
    from safetensors.torch import load_file

    from plate_inspect.checkpoint import Checkpoint
    from plate_inspect.errors import CheckpointError

    ckpt_dir = write_llama_like(tmp_path / "m", layers=1, dtype=torch.float32).path
    module = "model.layers.0.self_attn.q_proj"
    ckpt = Checkpoint.open(ckpt_dir)
    with pytest.raises(CheckpointError) as err:
        ckpt.read_weight(module)
    assert f"read its weight '{module}.weight'" in str(err.value) and "\n" not in str(err.value), str(err.value)
    weight, _ = ckpt.read_weight(f"{module}.weight")
    assert torch.equal(weight, load_file(str(ckpt_dir / "model.safetensors"))[f"{module}.weight"])
    with pytest.raises(CheckpointError, match=r"no weight named 'model\.layers\.0\.nothing'; .*logical_weights"):
        ckpt.read_weight("model.layers.0.nothing")
