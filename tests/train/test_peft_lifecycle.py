"""The `plate` PEFT method through peft's life-cycle options, where PLATE went wrong silently.

``low_cpu_mem_usage=True`` (get_peft_model, add_adapter, load_adapter): peft makes the adapter tensors on the meta
device for a state dict to fill. Without one (get_peft_model), A stayed on the meta device and torch's CPU kernels
read a meta operand as garbage: the logits moved by ~0.3 with A "zero", and training stepped nothing. Oracles: the
base model's logits (A = 0 is PLATE's start) and the A gradients of the same model made without the option.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

from plate_inspect.train.peft import PlateConfig, PlateLayer


@pytest.fixture(scope="module")
def qwen(tiny_qwen):
    """The directory holding the tiny Qwen2 (model/) and its bundle (bundle/): this module's own copy."""
    return tiny_qwen[0]


def _base(root):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)


def _ids():
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))


def _a_grads(model) -> dict[str, torch.Tensor]:
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "plate_A" in n}


def test_low_cpu_mem_usage_gives_a_zero_trainable_a(qwen):
    config = PlateConfig(bundle=str(qwen / "bundle"))
    plain = get_peft_model(_base(qwen), config)
    lean = get_peft_model(_base(qwen), config, low_cpu_mem_usage=True)
    a_tensors = [p for n, p in lean.named_parameters() if "plate_A" in n]
    assert len(a_tensors) == 14 and not any(a.is_meta for a in a_tensors)
    assert all(a.requires_grad and not a.any() for a in a_tensors)
    with torch.no_grad():
        assert torch.equal(lean(input_ids=_ids()).logits, _base(qwen)(input_ids=_ids()).logits)
    want, got = _a_grads(plain), _a_grads(lean)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)

    lean.add_adapter("two", PlateConfig(bundle=str(qwen / "bundle"), rho=2.0), low_cpu_mem_usage=True)
    two = [layer.plate_A["two"] for layer in lean.modules() if isinstance(layer, PlateLayer)]
    assert len(two) == 14 and not any(a.is_meta or a.any() for a in two)


def test_low_cpu_mem_usage_loading_keeps_the_saved_a(qwen, tmp_path):
    model = get_peft_model(_base(qwen), PlateConfig(bundle=str(qwen / "bundle")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "plate_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        want = model(input_ids=_ids()).logits
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_base(qwen), tmp_path / "adapter", low_cpu_mem_usage=True)
    loaded.load_adapter(tmp_path / "adapter", adapter_name="two", low_cpu_mem_usage=True)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_ids()).logits, want)
        loaded.set_adapter("two")
        assert torch.equal(loaded(input_ids=_ids()).logits, want)


@pytest.mark.parametrize(
    ("function", "peft_way"),
    [("merge_all", "merge_adapter()"), ("unmerge_all", "unmerge_adapter()"), ("unload", "merge_and_unload()")],
)
def test_apply_bundle_tools_refuse_a_peft_model(qwen, function, peft_way):
    """merge_all / unmerge_all / unload act on apply_bundle's layers; on a PeftModel they found none and returned
    as if done (unload handed back the PeftModel, adapters in place). Now: one line naming peft's own call."""
    from plate_inspect.errors import ConfigError
    from plate_inspect.train import layer as plate_layer

    model = get_peft_model(_base(qwen), PlateConfig(bundle=str(qwen / "bundle")))
    with pytest.raises(ConfigError, match=rf"{function}: .*PEFT.*{peft_way.replace('(', '[(]').replace(')', '[)]')}"):
        getattr(plate_layer, function)(model)
    assert sum(isinstance(m, PlateLayer) for m in model.modules()) == 14  # left as it was


def test_save_adapter_of_a_peft_model_names_save_pretrained(qwen, tmp_path):
    from plate_inspect.errors import ConfigError
    from plate_inspect.train.layer import save_adapter

    model = get_peft_model(_base(qwen), PlateConfig(bundle=str(qwen / "bundle")))
    with pytest.raises(ConfigError, match=r"save_adapter: .*PEFT.*save_pretrained"):
        save_adapter(model, tmp_path / "adapter.safetensors")
    assert not (tmp_path / "adapter.safetensors").exists()


def test_sequence_classification_head_trains_without_a_warning_for_peft_defaults(qwen):
    """task_type='SEQ_CLS': peft adds both of its head names, 'classifier' and 'score', to modules_to_save; a Qwen2
    head is 'score', and PLATE's no-match check warned about 'classifier', a name the user never gave."""
    import warnings

    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(qwen / "model", num_labels=3, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(base, PlateConfig(bundle=str(qwen / "bundle"), task_type="SEQ_CLS"))
    assert not [w for w in caught if "modules_to_save" in str(w.message)]
    trained = sorted({n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad and "plate_A" not in n})
    assert trained == ["score"]
    assert sum(p.numel() for n, p in model.named_parameters() if "plate_A" in n) == 14 * 4 * 16


def test_inject_adapter_in_model_with_low_cpu_mem_usage_gives_a_zero_a(qwen):
    """peft's ``inject_adapter_in_model(config, model, low_cpu_mem_usage=True)`` (no PeftModel, so none of its
    follow-up calls) left A on the meta device: logits 0.4 off the base model's with A "zero", and a state dict
    loaded by copy (``set_peft_model_state_dict`` without low_cpu_mem_usage) was a no-op into the meta A."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict

    config = PlateConfig(bundle=str(qwen / "bundle"))
    model = inject_adapter_in_model(config, _base(qwen), low_cpu_mem_usage=True)
    layers = [m for m in model.modules() if isinstance(m, PlateLayer)]
    assert layers and all(not m.plate_A["default"].is_meta and not m.plate_A["default"].any() for m in layers)
    assert all(m.plate_A["default"].requires_grad for m in layers)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, _base(qwen)(input_ids=_ids()).logits, rtol=0, atol=0)
    source = inject_adapter_in_model(PlateConfig(bundle=str(qwen / "bundle")), _base(qwen))
    with torch.no_grad():
        for n, p in source.named_parameters():
            if "plate_A" in n:
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
    set_peft_model_state_dict(model, get_peft_model_state_dict(source))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, source(input_ids=_ids()).logits, rtol=0, atol=0)
