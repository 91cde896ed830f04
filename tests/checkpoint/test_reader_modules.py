"""The checkpoint reader and the bundle split by job: each module imports first on its own (no cycle), the pieces
below the Checkpoint class never load it, and the public paths (``plate_inspect.checkpoint``,
``plate_inspect.bundle``) give every name of their ``__all__`` as the very object its home module defines.

Oracle: the home of each name, written out here (where it was moved to), and a fresh interpreter's sys.modules.
"""

from __future__ import annotations

import importlib

import pytest
from helpers_imports import modules_after_import

CHECKPOINT_HOMES = {
    "plate_inspect.safetensors_header": ("TensorInfo", "parse_safetensors_header"),
    "plate_inspect.fingerprints": ("fingerprint_bytes", "fingerprint_parts", "fingerprint_tensor"),
    "plate_inspect.dequantize": (
        "FP4_E2M1_VALUES",
        "FP8_DTYPES",
        "FP8_SCALE_DTYPES",
        "decode_e8m0",
        "decode_fp8",
        "decode_fp8_scale",
        "decode_mxfp4",
        "expand_block_scale",
        "fp8_scale_problem",
    ),
    "plate_inspect.quantized_layouts": (
        "COMPRESSED_TENSORS",
        "COMPRESSED_TENSORS_FORMATS",
        "SUPPORTED_QUANT_METHODS",
        "LogicalWeight",
        "require_float_dtype",
    ),
    "plate_inspect.model_files": (
        "INDEX_FILE",
        "SINGLE_FILE",
        "read_weight_map",
        "refuse_adapter",
        "single_file_is_read",
    ),
    "plate_inspect.dtypes": ("FLOAT_DTYPES",),
    "plate_inspect.checkpoint": ("Checkpoint", "SourceRef"),
}
BUNDLE_HOMES = {
    "plate_inspect.bundle_parts": (
        "encode_part",
        "finished_modules",
        "foreign_safetensors",
        "intact_records",
        "part_records",
        "read_part_tensors",
        "refuse_foreign_safetensors",
    ),
    "plate_inspect.bundle_reader": ("Bundle", "ModulePlate", "not_a_bundle", "read_problem", "stored_b_problem"),
    "plate_inspect.bundle_writer": (
        "API_REPLACE_HINT",
        "REPLACE_HINT",
        "BundleWriter",
        "describe_variant",
        "rescan_baseline",
        "write_file",
    ),
}
LEAVES = [m for m in CHECKPOINT_HOMES if m not in ("plate_inspect.dtypes", "plate_inspect.checkpoint")]


@pytest.mark.parametrize("leaf", LEAVES)
def test_each_piece_imports_first_without_the_checkpoint_class(leaf):
    loaded = modules_after_import(leaf)
    assert leaf in loaded and "plate_inspect.checkpoint" not in loaded
    assert not {"plate_inspect.bundle", "plate_inspect.hub", "safetensors"} & loaded


@pytest.mark.parametrize(
    "module", ["plate_inspect.bundle_parts", "plate_inspect.bundle_reader", "plate_inspect.bundle_writer"]
)
def test_each_bundle_module_imports_first(module):
    assert module in modules_after_import(module)


@pytest.mark.parametrize(
    ("public", "homes"), [("plate_inspect.checkpoint", CHECKPOINT_HOMES), ("plate_inspect.bundle", BUNDLE_HOMES)]
)
def test_the_public_path_gives_each_name_from_its_home(public, homes):
    module = importlib.import_module(public)
    for home, names in homes.items():
        source = importlib.import_module(home)
        for name in names:
            assert name in module.__all__, (public, name)
            assert getattr(module, name) is getattr(source, name), (public, name, home)
    assert all(hasattr(module, name) for name in module.__all__)


def test_the_bundle_module_is_the_format_and_loads_no_reader_or_writer():
    loaded = modules_after_import("plate_inspect.bundle")
    assert not {"plate_inspect.bundle_reader", "plate_inspect.bundle_writer", "plate_inspect.bundle_parts"} & loaded
