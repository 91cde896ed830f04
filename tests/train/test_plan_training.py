"""Plans applied in training (issue 15): a smaller k per module uses Q[:, :k], checked against a dense oracle."""

from __future__ import annotations

import json

import helpers_train
import pytest
import torch
from helpers_train import BACKBONE, dense_plate_weight, load_digits
from peft import PeftModel, get_peft_model

from plate_inspect.errors import ConfigError
from plate_inspect.train.layer import apply_bundle, load_adapter, plate_layers, save_adapter
from plate_inspect.train.peft import PlateConfig, PlateLayer


def _plan(bundle, ks: dict[str, int]) -> dict:
    identity = {"identity": bundle.manifest.identity}
    return {
        "format": "plate-plan",
        "format_version": 1,
        "bundle": identity,
        "modules": {m: {"k": k} for m, k in ks.items()},
    }


def test_plan_uses_the_bottom_prefix_of_q_against_dense_oracle(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    k2 = bundle.record("fc2").k // 2
    plan = _plan(bundle, {"fc2": k2})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    model = load_digits(ckpt)
    w0 = {m: getattr(model, m).weight.detach().clone() for m in BACKBONE}
    params = apply_bundle(model, bundle, plan=path)
    layers = plate_layers(model)
    assert layers["fc2"].k == k2 and layers["fc1"].k == bundle.record("fc1").k  # absent modules keep the bundle's k
    assert torch.equal(layers["fc2"].plate_Q, bundle.q("fc2")[:, :k2])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(5, 64, generator=g)
    h = x.double()
    for m in BACKBONE:  # oracle: dense W + rho E_B A Q[:, :k]^T with Q sliced from the bundle independently
        k = k2 if m == "fc2" else bundle.record(m).k
        w = dense_plate_weight(w0[m], bundle.b_idx(m), layers[m].plate_A.detach(), bundle.q(m)[:, :k], 0.5)
        h = torch.relu(h @ w.T + getattr(model, m).base.bias.double())
    oracle = h @ model.head1.weight.double().T + model.head1.bias.double()
    torch.testing.assert_close(model(x).double(), oracle, rtol=1e-5, atol=1e-5)
    # the adapter records k, so loading it applies the same plan
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    fresh = load_digits(ckpt)
    load_adapter(fresh, adapter)
    assert plate_layers(fresh)["fc2"].k == k2
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_plan_errors(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    too_big = bundle.record("fc1").k + 1
    with pytest.raises(ConfigError, match="fc1.*1\\.\\.\\d+"):
        apply_bundle(load_digits(ckpt), bundle, plan=_plan(bundle, {"fc1": too_big}))
    with pytest.raises(ConfigError, match="not in the bundle"):
        apply_bundle(load_digits(ckpt), bundle, plan=_plan(bundle, {"head1": 2}))
    wrong = _plan(bundle, {"fc1": 2})
    wrong["bundle"]["identity"] = "sha256:0000"
    with pytest.raises(ConfigError, match="made for bundle"):
        apply_bundle(load_digits(ckpt), bundle, plan=wrong)
    with pytest.raises(ConfigError, match="cannot read"):
        apply_bundle(load_digits(ckpt), bundle, plan=tmp_path / "missing.json")


def test_plan_is_tied_to_the_bundle_content_not_its_layout(digits_setup, tmp_path):
    """The layout-only source_signature (the same for any weights of these shapes, and any settings) no longer
    passes for the bundle; a plan of a bundle with other settings over the same weights is refused too."""
    root, ckpt, bundle = digits_setup
    by_layout = _plan(bundle, {"fc1": 2})
    by_layout["bundle"]["identity"] = bundle.manifest.source_signature
    with pytest.raises(ConfigError, match="made for bundle"):
        apply_bundle(load_digits(ckpt), bundle, plan=by_layout)
    other = helpers_train.digits_bundle(ckpt, tmp_path / "other", r=16, tau=0.5)
    assert other.manifest.source_signature == bundle.manifest.source_signature
    with pytest.raises(ConfigError, match="made for bundle"):
        apply_bundle(load_digits(ckpt), other, plan=_plan(bundle, {"fc1": 2}))
    assert apply_bundle(load_digits(ckpt), other, plan=_plan(other, {"fc1": 2}))  # its own plan applies


def test_peft_plate_config_plan(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    k1 = 3
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(bundle, {"fc1": k1})))
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), plan=str(path)))
    layer = pm.base_model.model.fc1
    assert isinstance(layer, PlateLayer) and layer.plate_A["default"].shape == (bundle.record("fc1").r, k1)
    assert torch.equal(layer.plate_Q["default"], bundle.q("fc1")[:, :k1])
    with torch.no_grad():
        layer.plate_A["default"].normal_()
    x = torch.randn(3, 64)
    out = pm(x).detach()
    pm.save_pretrained(tmp_path / "adapter")  # the plan is stored in adapter_config.json as a dict
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    torch.testing.assert_close(loaded(x), out, rtol=0, atol=0)
