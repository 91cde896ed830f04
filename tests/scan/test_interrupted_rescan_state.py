"""What info, Bundle.load and a refused scan say of a rescan that was interrupted, and what a rescan of every changed
weight says when it finishes.

An interrupted rescan's part files hold every module of the bundle it updates, so it was described as "all 14
modules written, not finalised ... the written modules are kept", although the modules of weights it had not reached
still held the old weights' geometry and are recomputed when it resumes; info showed the previous finished scan's
statistics as this bundle's; and a rescan that recomputed every module said "computed 14 of 14 modules", as a first
scan does. Oracle: which weights the test changed, and sha256 of the new weights (the part headers' fingerprints).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from helpers_cli import run_cli
from safetensors.torch import load_file, save_file

import plate_inspect
from plate_inspect import Bundle
from plate_inspect.bundle import finished_modules
from plate_inspect.errors import BundleError

R = 8


class _Stop(Exception):
    pass


def _sha256(t: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _scale_every_weight(model) -> dict[str, str]:
    """Every target weight x1.5 (bf16); returns {module: sha256 of its new weight}."""
    new = {}
    for shard in sorted(model.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name, t in tensors.items():
            if name.endswith("proj.weight"):
                tensors[name] = (t.float() * 1.5).to(torch.bfloat16)
                new[name.removesuffix(".weight")] = _sha256(tensors[name])
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return new


@pytest.fixture
def rescanning(tmp_path, qwen_ckpt):
    model, out = tmp_path / "model", tmp_path / "b"
    shutil.copytree(qwen_ckpt.path, model)
    plate_inspect.scan(model, out, r=R)
    new = _scale_every_weight(model)
    assert len(new) == 14

    def stop_in_layer_1(event):  # layer 0's part (7 modules) is rewritten, layer 1 is being computed
        if event.done == 10:
            raise _Stop

    with pytest.raises(_Stop):
        plate_inspect.scan(model, out, r=R, progress=stop_in_layer_1)
    return model, out, new


def test_an_interrupted_rescan_says_how_many_modules_it_recomputed(rescanning):
    model, out, new = rescanning
    manifest = Bundle.load(out, require_complete=False).manifest
    parts = finished_modules(out, manifest)
    recomputed = {n for n, rec in parts.items() if rec.fingerprint == new[n]}
    assert len(parts) == 14 and len(recomputed) == 7  # every module has a part; layer 0's hold the new weights
    with pytest.raises(BundleError) as info:
        Bundle.load(out)
    message = str(info.value)
    assert "bundle is being rescanned: the rescan was interrupted after recomputing 7 modules for changed weights" in (
        message
    )
    assert "all 14 modules" not in message and "only modules whose weights changed are recomputed" in message
    code, output = run_cli("info", out)
    assert "(UNFINISHED: rescan interrupted after recomputing 7 modules)" in output, output
    assert "last finished scan (not this unfinished one): " in output
    code, output = run_cli("scan", model, "--out", out, "--r", "4", "-q")
    assert code == 2
    assert "holds an unfinished (rescan interrupted after recomputing 7 modules) bundle made with other settings" in (
        " ".join(output.split())
    )


def test_the_resumed_rescan_finishes_and_recomputes_the_rest(rescanning):
    model, out, new = rescanning
    code, output = run_cli("scan", model, "--out", out, "--r", R, "-q")
    assert code == 0, output
    assert (
        "resumed an interrupted rescan: 14 of 14 modules changed since the bundle was made; recomputed 7 in the "
        "interrupted run and 7 in this one, kept 0 unchanged"
    ) in output
    modules = json.loads((out / "manifest.json").read_text())["modules"]
    assert {n: m["fingerprint"] for n, m in modules.items()} == new


def test_a_rescan_of_every_changed_weight_says_so(tmp_path, qwen_ckpt):
    model, out = tmp_path / "model", tmp_path / "b"
    shutil.copytree(qwen_ckpt.path, model)
    plate_inspect.scan(model, out, r=R)
    _scale_every_weight(model)
    code, output = run_cli("scan", model, "--out", out, "--r", R, "-q")
    assert code == 0, output
    assert "14 of 14 modules changed since the bundle was made: recomputed 14, kept 0" in output, output
    assert "computed 14 of 14 modules" not in output.replace("recomputed", "")
    code, output = run_cli("info", out)
    assert "\nscan: " in output and "last finished scan" not in output  # finished: its own statistics
