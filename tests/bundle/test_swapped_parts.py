"""Part files that hold other modules than the manifest puts in them: two layers' parts swapped (or renamed) by hand.

Reading such a bundle said per module "cannot read '...spectrum' (the part file is damaged: File does not contain
tensor ...)", and info/health, which check part headers only, found nothing wrong. Each now says which layer's
modules the file holds instead of its own, and a rescan into the bundle repairs it. Oracle: the swap the test made.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers_cli import assert_user_error, run_cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import plate_inspect
from plate_inspect import Bundle
from plate_inspect.errors import BundleError

R = 8


@pytest.fixture(scope="module")
def scanned(qwen_ckpt, tmp_path_factory):
    return plate_inspect.scan(qwen_ckpt.path, tmp_path_factory.mktemp("swap") / "b", r=R).path


def _swapped(bundle, dest):
    shutil.copytree(bundle, dest)
    a, b = dest / "layer-00000.safetensors", dest / "layer-00001.safetensors"
    a.rename(dest / "tmp")
    b.rename(a)
    (dest / "tmp").rename(b)
    return dest


def test_reading_a_swapped_part_names_the_layer_it_holds(scanned, tmp_path):
    b = Bundle.load(_swapped(scanned, tmp_path / "b"))
    with pytest.raises(BundleError) as info:
        b.q("model.layers.0.self_attn.q_proj")
    message = str(info.value)
    assert "layer-00000.safetensors: module 'model.layers.0.self_attn.q_proj': the part file holds layer 1's " in (
        message
    )
    assert "7 modules (model.layers.1." in message and "not layer 0's 7 modules the manifest puts in it" in message
    assert "swapped by hand" in message and "rerun the scan that made this bundle" in message
    assert "does not contain tensor" not in message
    problems = b.damaged_parts()
    assert sorted(problems) == ["layer-00000.safetensors", "layer-00001.safetensors"]
    assert problems["layer-00001.safetensors"].startswith("holds layer 0's 7 modules (model.layers.0.")


def test_verify_and_health_say_what_happened_and_a_rescan_repairs_it(scanned, qwen_ckpt, tmp_path):
    path = _swapped(scanned, tmp_path / "b")
    code, output = run_cli("verify", path, "--json")  # every problem (the console shows the first 10)
    assert code == 1 and "File does not contain tensor" not in output, output
    problems = [" ".join(problem.split()) for problem in json.loads(output)["problems"]]
    assert sum("the part file holds layer 1's 7 modules" in problem for problem in problems) == 7, output
    assert sum("the part file holds layer 0's 7 modules" in problem for problem in problems) == 7, output
    assert_user_error(["health", path], "layer-00000.safetensors (holds layer 1's 7 modules", "swapped by hand")
    code, output = run_cli("scan", qwen_ckpt.path, "--out", path, "--r", R, "--quiet")
    assert code == 0, output
    assert "kept 0 modules, recomputed 14 whose part files were missing or unreadable (of 14)" in output, output
    code, output = run_cli("verify", path)
    assert code == 0 and "ok: 14 modules verified" in output, output


def test_a_part_lacking_one_modules_tensors_names_it(scanned, tmp_path):
    """Not a swap: the file lacks a module's tensors and holds no other part's; said as such."""
    path = tmp_path / "b"
    shutil.copytree(scanned, path)
    part = path / "layer-00000.safetensors"
    with safe_open(str(part), framework="pt") as f:
        metadata = f.metadata()
    tensors = {k: v for k, v in load_file(str(part)).items() if not k.startswith("model.layers.0.mlp.up_proj.")}
    save_file(tensors, str(part), metadata=metadata)
    b = Bundle.load(path)
    assert b.damaged_parts() == {
        "layer-00000.safetensors": "lacks the tensors of layer 0's 1 module (model.layers.0.mlp.up_proj) that the "
        "manifest puts in it"
    }
    with pytest.raises(BundleError, match="the part file lacks the tensors of layer 0's 1 module"):
        b.spectrum("model.layers.0.mlp.up_proj")
    assert b.spectrum("model.layers.0.mlp.down_proj").numel() > 0  # the others still read
