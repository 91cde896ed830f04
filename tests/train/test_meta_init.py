"""PLATE on models whose weights are on the meta device (FSDP2 meta init, ranks that load nothing themselves).

The weight check and B/Q wait until the weights are loaded (``AwaitingWeights``); A comes from a state dict or
``finish_meta_init`` zeroes it. Oracle: the same adapter made the ordinary way, on loaded weights.
"""

from __future__ import annotations

import pytest
import torch
from helpers_train import BACKBONE, load_digits, randomize_adapters
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

from plate_inspect.errors import BundleError
from plate_inspect.experiments import digits
from plate_inspect.train.layer import apply_bundle, finish_meta_init, load_adapter, plate_layers, save_adapter
from plate_inspect.train.peft import PlateConfig, PlateLayer


def _meta_digits() -> digits.DigitsMLP:
    with torch.device("meta"):
        return digits.DigitsMLP()


def _peft_keys(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A base checkpoint's keys under a PEFT model's names (``fc1.weight`` -> ``fc1.base_layer.weight``)."""
    keys = set(model.state_dict())
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        wrapped = f"{module}.base_layer.{leaf}"
        out[wrapped if wrapped in keys else key] = value
    return out


def _x() -> torch.Tensor:
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(1))


def test_peft_model_made_on_meta_matches_the_ordinary_one(digits_setup):
    _, ckpt, bundle = digits_setup
    state = load_file(str(ckpt))
    ref = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), rho=0.5))
    randomize_adapters([p for n, p in ref.named_parameters() if "plate_A" in n], seed=3)

    pm = get_peft_model(_meta_digits(), PlateConfig(bundle=str(bundle.path), rho=0.5))  # nothing to check yet
    layer = pm.base_model.model.fc1
    assert isinstance(layer, PlateLayer) and layer.plate_A["default"].is_meta
    assert layer.plate_Q["default"].device.type == "cpu"  # B/Q wait with real values (accelerate keeps them)
    pm.to_empty(device="cpu")
    inner = pm.base_model.model
    inner.load_state_dict(_peft_keys(inner, state), strict=False)
    with pytest.raises(BundleError, match=r"module 'fc1': its PLATE A was made on the meta device .*finish_meta_init"):
        pm(_x())  # A is whatever to_empty() left: refused, not used
    assert finish_meta_init(pm) == 3
    assert finish_meta_init(pm) == 0  # done once
    for m in BACKBONE:  # B/Q reloaded exactly, A zeroed
        got, want = getattr(inner, m), getattr(ref.base_model.model, m)
        assert torch.equal(got.plate_B_idx["default"], want.plate_B_idx["default"])
        assert torch.equal(got.plate_Q["default"], want.plate_Q["default"])
        assert not got.plate_A["default"].any()
    torch.testing.assert_close(pm(_x()), load_digits(ckpt)(_x()), rtol=0, atol=0)  # A = 0: the base model
    with torch.no_grad():
        for m in BACKBONE:
            getattr(inner, m).plate_A["default"].copy_(getattr(ref.base_model.model, m).plate_A["default"])
    torch.testing.assert_close(pm(_x()), ref(_x()), rtol=0, atol=0)
    records = pm.peft_config["default"].module_records
    assert records == ref.peft_config["default"].module_records  # the weight sketches were filled in


def test_first_forward_settles_when_a_state_dict_gave_a(digits_setup, tmp_path):
    """accelerate's FSDP2 loading broadcasts rank 0's state dict (A included): no call needed, checked at forward."""
    _, ckpt, bundle = digits_setup
    ref = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path)))
    randomize_adapters([p for n, p in ref.named_parameters() if "plate_A" in n], seed=4)
    pm = get_peft_model(_meta_digits(), PlateConfig(bundle=str(bundle.path)))
    pm.base_model.model.load_state_dict(ref.base_model.model.state_dict(), assign=True)  # as accelerate does
    with torch.inference_mode():  # a first forward in inference mode leaves B/Q usable for training after
        torch.testing.assert_close(pm(_x()), ref(_x()), rtol=0, atol=0)
    pm(_x()).sum().backward()
    assert pm.base_model.model.fc2.plate_A["default"].grad is not None
    pm.save_pretrained(tmp_path / "adapter")  # the adapter saved from it loads onto the ordinary model
    back = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    torch.testing.assert_close(back(_x()), ref(_x()), rtol=0, atol=0)


def test_other_or_missing_weights_are_refused_when_they_arrive(digits_setup):
    _, ckpt, bundle = digits_setup
    state = load_file(str(ckpt))
    pm = get_peft_model(_meta_digits(), PlateConfig(bundle=str(bundle.path)))
    with pytest.raises(BundleError, match=r"module 'fc1': its weight is still on the meta device; load the weights"):
        finish_meta_init(pm)
    pm.to_empty(device="cpu")
    inner = pm.base_model.model
    with torch.no_grad():  # what to_empty() leaves is arbitrary (freed memory can even hold these very weights)
        for m in BACKBONE:
            getattr(inner, m).base_layer.weight.fill_(0.25)
    with pytest.raises(BundleError, match=r"module 'fc1': weight fingerprint differs.*were they loaded after"):
        finish_meta_init(pm)
    state["fc2.weight"] = state["fc2.weight"] * 1.01
    inner.load_state_dict(_peft_keys(inner, state), strict=False)
    with pytest.raises(BundleError, match=r"module 'fc2': weight fingerprint differs"):
        finish_meta_init(pm)
    unchecked = get_peft_model(_meta_digits(), PlateConfig(bundle=str(bundle.path), check_fingerprints=False))
    unchecked.to_empty(device="cpu")
    assert finish_meta_init(unchecked) == 3  # check skipped (warned at get_peft_model): B/Q still reloaded
    assert torch.equal(unchecked.base_model.model.fc3.plate_Q["default"], bundle.q("fc3"))


def test_a_carrying_adapter_is_refused_on_meta_weights(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), carry_geometry=True))
    pm.save_pretrained(tmp_path / "carried")
    with pytest.raises(BundleError, match=r"adapter module 'fc1': the model's weights are on the meta device"):
        PeftModel.from_pretrained(_meta_digits(), tmp_path / "carried")


def test_apply_bundle_on_meta_then_finish_matches_the_ordinary_layers(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    state = load_file(str(ckpt))
    ref = load_digits(ckpt)
    randomize_adapters(apply_bundle(ref, bundle, rho=0.7), seed=5)
    save_adapter(ref, tmp_path / "a.safetensors")

    model = _meta_digits()
    apply_bundle(model, bundle, rho=0.7)
    with pytest.raises(BundleError, match=r"the model's weights are on the meta device \(module 'fc1'\)"):
        load_adapter(_meta_digits(), tmp_path / "a.safetensors")  # A cannot take values there
    model.to_empty(device="cpu")
    model.load_state_dict(_plate_linear_keys(state), strict=False)
    with pytest.raises(BundleError, match=r"module 'fc1': its PLATE A was made on the meta device"):
        model(_x())
    load_adapter(model, tmp_path / "a.safetensors")  # A from the adapter: the forward settles the rest
    torch.testing.assert_close(model(_x()), ref(_x()), rtol=0, atol=0)
    assert all(not layer._awaiting for layer in plate_layers(model).values())

    assigned = _meta_digits()  # weights assigned, never to_empty(): A is still meta, finish gives a zero one
    apply_bundle(assigned, bundle)
    assigned.load_state_dict(_plate_linear_keys(state), strict=False, assign=True)
    assert finish_meta_init(assigned) == 3
    assert not assigned.fc1.plate_A.is_meta and not assigned.fc1.plate_A.any() and assigned.fc1.plate_A.requires_grad
    torch.testing.assert_close(assigned(_x()), load_digits(ckpt)(_x()), rtol=0, atol=0)


def _plate_linear_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A base checkpoint's keys under apply_bundle's names (``fc1.weight`` -> ``fc1.base.weight``)."""
    return {
        (f"{k.split('.')[0]}.base.{k.split('.')[1]}" if k.split(".")[0] in BACKBONE else k): v for k, v in state.items()
    }


def test_the_weight_check_leaves_the_weights_storage_resizable(digits_setup):
    """FSDP2 frees an unsharded parameter by resizing its storage to 0 after the forward; the check runs in that
    forward (a rank whose layers waited for the weights): numpy must never have seen the weight's storage."""
    from plate_inspect.train.layer import check_module_against_record

    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    check_module_against_record(model.fc1, "fc1", bundle.record("fc1"))
    model.fc1.weight.untyped_storage().resize_(0)  # RuntimeError "not resizable" before


def test_a_compiled_model_settles_at_its_first_call(digits_setup):
    """The settling step is left out of the graph (torch.compiler.disable); the compiled model matches eager."""
    _, ckpt, bundle = digits_setup
    ref = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path)))
    randomize_adapters([p for n, p in ref.named_parameters() if "plate_A" in n], seed=6)
    pm = get_peft_model(_meta_digits(), PlateConfig(bundle=str(bundle.path)))
    pm.base_model.model.load_state_dict(ref.base_model.model.state_dict(), assign=True)
    compiled = torch.compile(pm, backend="aot_eager")
    torch.testing.assert_close(compiled(_x()), ref(_x()), rtol=0, atol=0)
    assert not pm.base_model.model.fc1._awaiting
    torch.testing.assert_close(compiled(_x()), ref(_x()), rtol=0, atol=0)
