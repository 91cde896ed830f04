"""PLATE on a model whose layers accelerate offloads (``device_map`` with ``"disk"``/``"cpu"`` offload).

Such a layer holds its weight on the meta device between calls (accelerate's hook brings it in for each call), so
the PLATE routes took it for a model made on the meta device: ``get_peft_model`` / ``apply_bundle`` deferred the
weight check, and the first forward failed saying to load the weights with ``to_empty()`` (which would wipe the
offloaded model); ``PeftModel.from_pretrained`` failed inside torch ("Cannot copy out of meta tensor"), after
peft's offload bookkeeping had already rewritten the base checkpoint's file (loaded by a relative path) in place.
Now each route refuses in one line, naming the module and what to do, before anything is changed on disk.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from peft import PeftModel, get_peft_model

from plate_inspect.errors import BundleError
from plate_inspect.train.layer import apply_bundle
from plate_inspect.train.peft import PlateConfig

DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def qwen(tiny_qwen):
    """The directory holding the tiny Qwen2 (model/) and its bundle (bundle/): this module's own copy."""
    return tiny_qwen[0]


def _offloaded(root, tmp_path, path=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path or root / "model", dtype=torch.float32, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload")
    )
    assert model.model.layers[1].self_attn.q_proj.weight.is_meta  # offloaded: accelerate brings it in per call
    return model


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


WHAT = r"module 'model\.layers\.1\.[a-z_.]+': accelerate offloads its weight .*device_map"


def test_get_peft_model_and_apply_bundle_refuse_offloaded_layers(qwen, tmp_path):
    with pytest.raises(BundleError, match=WHAT):
        get_peft_model(_offloaded(qwen, tmp_path), PlateConfig(bundle=str(qwen / "bundle")))
    with pytest.raises(BundleError, match=WHAT):
        apply_bundle(_offloaded(qwen, tmp_path), qwen / "bundle")
    # the layers kept in memory can be adapted
    model = get_peft_model(
        _offloaded(qwen, tmp_path), PlateConfig(bundle=str(qwen / "bundle"), target_modules=r".*\.layers\.0\..*")
    )
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, _offloaded(qwen, tmp_path)(input_ids=ids).logits)


@pytest.mark.parametrize("carry", [False, True])
def test_from_pretrained_refuses_offloaded_layers_and_leaves_the_checkpoint(qwen, tmp_path, carry, monkeypatch):
    """peft's offload bookkeeping writes its renamed copy at the checkpoint's path with the leading '/' lost: over
    the checkpoint itself when the model was loaded by a relative path (as here), else under the working directory."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(qwen / "model", dtype=torch.float32)
    get_peft_model(base, PlateConfig(bundle=str(qwen / "bundle"), carry_geometry=carry)).save_pretrained(
        tmp_path / "adapter"
    )
    before = _digest(qwen / "model" / "model.safetensors")
    monkeypatch.chdir(qwen)
    with pytest.raises(BundleError, match=WHAT):
        PeftModel.from_pretrained(_offloaded(qwen, tmp_path, path="model"), tmp_path / "adapter")
    assert _digest(qwen / "model" / "model.safetensors") == before
