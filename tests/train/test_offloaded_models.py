"""PLATE on a model whose layers accelerate offloads (``device_map`` with ``"disk"``/``"cpu"`` offload).

Such a layer holds its weight on the meta device between calls (accelerate's hook brings it in for each call), so
the PLATE routes took it for a model made on the meta device: ``get_peft_model`` / ``apply_bundle`` deferred the
weight check, and the first forward failed saying to load the weights with ``to_empty()`` (which would wipe the
offloaded model); ``PeftModel.from_pretrained`` failed inside torch ("Cannot copy out of meta tensor"), after
peft's offload bookkeeping had already rewritten the base checkpoint's file (loaded by a relative path) in place.
Now the PEFT method adapts such layers (the weight is brought in for the check and for merging, as peft's
``onload_layer`` does for LoRA; B/Q/A live where the hook runs the layer): oracle, the same adapter on the model
loaded whole. apply_bundle and ``PeftModel.from_pretrained`` (which takes the hooks away) refuse in one line, naming
the module and what to do, before anything is changed on disk.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from helpers_train import randomize_adapters, save_tiny_qwen2
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from plate_inspect import scan
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


def _loaded(root):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))


def test_the_peft_method_adapts_offloaded_layers_as_loaded_ones(qwen, tmp_path):
    before = _digest(qwen / "model" / "model.safetensors")
    ref = get_peft_model(_loaded(qwen), PlateConfig(bundle=str(qwen / "bundle")))
    randomize_adapters([p for n, p in ref.named_parameters() if "plate_A" in n], seed=3)
    model = get_peft_model(_offloaded(qwen, tmp_path), PlateConfig(bundle=str(qwen / "bundle")))
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    assert layer.base_layer.weight.is_meta and layer.plate_Q["default"].device.type == "cpu"  # still offloaded
    assert model.get_nb_trainable_parameters() == ref.get_nb_trainable_parameters()
    set_peft_model_state_dict(model, get_peft_model_state_dict(ref))
    ids, base = _ids(), _loaded(qwen)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_layer = ref.base_model.model.model.layers[1].self_attn.q_proj
    assert ref_layer.plate_A["default"].grad.abs().max() > 0
    torch.testing.assert_close(layer.plate_A["default"].grad, ref_layer.plate_A["default"].grad, rtol=0, atol=0)
    with torch.no_grad():
        model.merge_adapter()  # into the offloaded weights (kept in memory by peft's onload_layer)
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
        with model.disable_adapter():  # unmerges the offloaded weights itself: the base model's output
            torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)
        merged = model.merge_and_unload()
        assert type(merged.model.layers[1].self_attn.q_proj) is torch.nn.Linear
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    assert _digest(qwen / "model" / "model.safetensors") == before


def test_the_weight_check_reads_the_offloaded_weights(qwen, tmp_path):
    save_tiny_qwen2(tmp_path / "other", seed=5)
    other = scan(tmp_path / "other", tmp_path / "other_bundle", r=4, tau=0.8, max_rank=16, overwrite=True)
    with pytest.raises(BundleError, match=r"module 'model\.layers\.1\.[a-z_.]+': weight fingerprint differs"):
        get_peft_model(
            _offloaded(qwen, tmp_path), PlateConfig(bundle=str(other.path), target_modules=r".*\.layers\.1\..*")
        )


def test_apply_bundle_refuses_offloaded_layers_naming_the_peft_method(qwen, tmp_path):
    with pytest.raises(BundleError, match=WHAT + r".*apply_bundle needs it in memory.*get_peft_model"):
        apply_bundle(_offloaded(qwen, tmp_path), qwen / "bundle")
    model = _offloaded(qwen, tmp_path)  # the layers kept in memory can be adapted
    apply_bundle(model, qwen / "bundle", modules=[f"model.layers.0.{m}" for m in ("self_attn.q_proj", "mlp.up_proj")])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, _loaded(qwen)(input_ids=_ids()).logits)


def test_a_saved_adapter_loads_onto_an_offloaded_model_the_way_the_refusal_says(qwen, tmp_path):
    """``PeftModel.from_pretrained`` is refused (below); get_peft_model + set_peft_model_state_dict is the way."""
    ref = get_peft_model(_loaded(qwen), PlateConfig(bundle=str(qwen / "bundle")))
    randomize_adapters([p for n, p in ref.named_parameters() if "plate_A" in n], seed=4)
    ref.save_pretrained(tmp_path / "adapter")
    model = get_peft_model(_offloaded(qwen, tmp_path), PlateConfig.from_pretrained(tmp_path / "adapter"))
    loaded = set_peft_model_state_dict(model, load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert not loaded.unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=0, atol=0)


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


def test_low_cpu_mem_usage_gives_offloaded_layers_a_zero_a(qwen, tmp_path):
    """get_peft_model(..., low_cpu_mem_usage=True) on an offloaded model: the zero start of A was given only beside a
    weight in memory, so the offloaded layers kept a meta A (NaN logits)."""
    model = get_peft_model(_offloaded(qwen, tmp_path), PlateConfig(bundle=str(qwen / "bundle")), low_cpu_mem_usage=True)
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    a = layer.plate_A["default"]
    assert a.device.type == "cpu" and a.requires_grad and not a.any()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, _loaded(qwen)(input_ids=_ids()).logits)
