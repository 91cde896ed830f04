"""verify judges stored B indices with the reader's check (Bundle.checked_b_idx's stored_b_problem), so it says what
is wrong as reading the module does: how many indices against r, the range, or the order.

verify had its own copy of the check, whose first message lumped two faults together ("out of range or not r=8 of
them"). Oracle: the damage the test writes into the part file, with its header (the records) kept.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import plate_inspect
from plate_inspect.bundle import Bundle

R = 8
NAME = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def scanned(qwen_ckpt, tmp_path_factory):
    return plate_inspect.scan(qwen_ckpt.path, tmp_path_factory.mktemp("verify-b") / "b", r=R, layers=[0]).path


def _with_b(bundle, tmp_path, change):
    """A copy of ``bundle`` whose module NAME stores ``change(B)`` as its B indices."""
    out = tmp_path / "b"
    shutil.copytree(bundle, out)
    part = out / Bundle.load(out).record(NAME).file
    with safe_open(str(part), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(part))
    tensors[f"{NAME}.plate_B_idx"] = change(tensors[f"{NAME}.plate_B_idx"]).contiguous()
    save_file(tensors, str(part), metadata=metadata)
    return out


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda b: b[:-1], f"B holds {R - 1} indices, the manifest says r={R}"),
        (lambda b: torch.cat([b[:-1], torch.tensor([10**6])]), "B indices out of range [0, "),
        (lambda b: b.flip(0), "B indices not strictly ascending"),
    ],
    ids=["too-few", "out-of-range", "descending"],
)
def test_verify_says_what_is_wrong_with_b(scanned, tmp_path, change, said):
    report = plate_inspect.verify(_with_b(scanned, tmp_path, change))
    mine = [p for p in report.problems if "digest mismatch" not in p]  # the digest check says B or Q changed too
    assert len(mine) == 1 and mine[0].startswith(f"module '{NAME}': {said}"), report.problems
    assert all(NAME in p for p in report.problems), report.problems  # the other modules are intact


def test_an_intact_bundle_has_no_b_problem(scanned):
    assert plate_inspect.verify(scanned).problems == []
