"""A rescan into a bundle whose manifest.json was edited by hand: what its summary says changed and recomputed.

The scan keeps a module when its part file's header records the weight just read; the manifest's copy of that record
is not what it checks. A hand-edited fingerprint in the manifest alone made the rescan say "1 of 7 modules changed
since the bundle was made: recomputed 0, kept 7": the count read the manifest, the work the part files. Oracle: which
weights were changed by the test itself (sha256 of the bytes safetensors loads, before and after).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import torch
from helpers_cli import run_cli
from oracles import load_all
from safetensors.torch import load_file, save_file

ARGS = ("--r", "8", "--layers", "0", "--quiet")
EDITED = "model.layers.0.mlp.down_proj"


def _sha256(t: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _scan(model, out) -> str:
    code, output = run_cli("scan", model, "--out", out, *ARGS)
    assert code == 0, output
    return output


def _edit_manifest_fingerprint(out) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["modules"][EDITED]["fingerprint"] = "sha256:" + "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _scale_weight(model, module: str) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = model / index["weight_map"][f"{module}.weight"]
    tensors = load_file(str(shard))
    tensors[f"{module}.weight"] = (tensors[f"{module}.weight"].float() * 1.5).to(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_an_edited_manifest_fingerprint_is_not_counted_as_changed_weights(tmp_path, qwen_ckpt):
    model, out = tmp_path / "model", tmp_path / "b"
    shutil.copytree(qwen_ckpt.path, model)
    _scan(model, out)
    _edit_manifest_fingerprint(out)
    output = _scan(model, out)
    assert "no module changed since the bundle was made: kept all 7, recomputed 0" in output, output
    assert "1 of 7" not in output
    note = output[output.index("note: manifest.json's record of 1 module") :]
    assert EDITED in note and "disagreed with its part file's header" in note, output
    stats = json.loads((out / "scan_stats.json").read_text())
    assert (stats["modules_changed"], stats["modules_scanned"], stats["manifest_disagreed"]) == (0, 0, [EDITED])
    # the manifest was rewritten from the part file: the weight's own fingerprint again, and verify passes
    weight = load_all(model)[f"{EDITED}.weight"]
    assert json.loads((out / "manifest.json").read_text())["modules"][EDITED]["fingerprint"] == _sha256(weight)
    code, verified = run_cli("verify", out)
    assert code == 0 and "ok: 7 modules verified" in verified, verified
    assert "manifest.json's record" not in _scan(model, out)  # the next rescan finds nothing to say


def test_an_edited_manifest_beside_a_changed_weight_counts_the_changed_weight_only(tmp_path, qwen_ckpt):
    """The edited module's weight unchanged, another's changed: one change, one recomputed, the edit named."""
    model, out = tmp_path / "model", tmp_path / "b"
    shutil.copytree(qwen_ckpt.path, model)
    _scan(model, out)
    before = load_all(model)
    _edit_manifest_fingerprint(out)
    _scale_weight(model, "model.layers.0.self_attn.q_proj")
    after = load_all(model)
    changed = [n for n in before if ".layers.0." in n and _sha256(before[n]) != _sha256(after[n])]
    assert changed == ["model.layers.0.self_attn.q_proj.weight"]
    output = _scan(model, out)
    assert "1 of 7 modules changed since the bundle was made: recomputed 1, kept 6" in output, output
    assert f"manifest.json's record of 1 module ({EDITED})" in output


def test_an_edited_manifest_record_of_a_changed_weight_counts_it_once(tmp_path, qwen_ckpt):
    """The edited module's weight changed too: it is one changed, recomputed module (and the edit is named)."""
    model, out = tmp_path / "model", tmp_path / "b"
    shutil.copytree(qwen_ckpt.path, model)
    _scan(model, out)
    _edit_manifest_fingerprint(out)
    _scale_weight(model, EDITED)
    output = _scan(model, out)
    assert "1 of 7 modules changed since the bundle was made: recomputed 1, kept 6" in output, output
    assert f"manifest.json's record of 1 module ({EDITED})" in output


def test_verify_against_the_model_says_the_manifest_was_edited_not_the_weights(tmp_path, qwen_ckpt):
    """verify said 'weight fingerprint differs: the bundle was made for other weights' and diagnosed a fine-tune; the
    part file's record and the weights agree, so it names the edit and the mend (and no changed weights)."""
    from plate_inspect import verify

    model, out = tmp_path / "model", tmp_path / "b"
    shutil.copytree(qwen_ckpt.path, model)
    _scan(model, out)
    _edit_manifest_fingerprint(out)
    report = verify(out, model)
    assert report.changed == [] and not any("fine-tune" in n for n in report.notes), report
    edited = [p for p in report.problems if p.startswith(f"module '{EDITED}'")]
    assert edited == [
        f"module '{EDITED}': manifest.json records another weight fingerprint than its part file "
        "layer-00000.safetensors, whose record matches the checkpoint's weight: the manifest was edited; rescan the "
        "model into the bundle (nothing is recomputed, the manifest is rewritten from the part files)"
    ]
    _scale_weight(model, EDITED)  # now the weights did change: that is said as before
    report = verify(out, model)
    assert report.changed == [EDITED]
    assert f"module '{EDITED}': weight fingerprint differs: the bundle was made for other weights" in report.problems
