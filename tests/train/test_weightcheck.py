"""Adapters survive a cast of the base model (bf16/fp16 rounded copies pass), other weights are still refused."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers_train import (
    BACKBONE,
    digits_bundle,
    digits_checkpoint,
    fp8_setup,
    load_digits,
    model_holding,
    randomize_adapters,
)
from peft import PeftModel, get_peft_model

from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError
from plate_inspect.train.core import geometry_digest
from plate_inspect.train.layer import apply_bundle, load_adapter, plate_layers, save_adapter
from plate_inspect.train.peft import PlateConfig
from plate_inspect.train.weightcheck import sketch_distance, sketch_weight, unit_roundoff


@pytest.fixture(scope="module")
def fp32_setup(tmp_path_factory):
    """A float32 digits checkpoint and its bundle (the bundle records the checkpoint's path as its source)."""
    root = tmp_path_factory.mktemp("weightcheck")
    _, ckpt = digits_checkpoint(root / "ckpt", seed=0)
    bundle = digits_bundle(ckpt, root / "bundle", r=16, tau=0.8)
    other, _ = digits_checkpoint(root / "other", seed=3)
    return root, ckpt, bundle, other


def _without_source(bundle: Bundle, where: Path) -> Bundle:
    """A copy of the bundle whose recorded source checkpoint no longer exists (moved, other machine)."""
    shutil.copytree(bundle.path, where)
    manifest = json.loads((where / "manifest.json").read_text())
    manifest["source"] = {"kind": "local", "id": str(where.parent / "gone" / "model.safetensors")}
    (where / "manifest.json").write_text(json.dumps(manifest))
    return Bundle.load(where)


def test_sketch_estimates_the_relative_change_against_a_dense_oracle():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g, dtype=torch.float64)
    ref = sketch_weight(w)
    rounded = w.to(torch.bfloat16).double()
    exact = float((rounded - w).norm() / w.norm())  # dense oracle of ||E||_F / ||W||_F
    est = sketch_distance(sketch_weight(rounded), ref)
    assert 0.4 * exact < est < 2.5 * exact
    assert est <= 2 * unit_roundoff(torch.bfloat16)
    planted = w + 0.01 * w.norm() / (96 * 80) ** 0.5 * torch.randn(96, 80, generator=g, dtype=torch.float64)
    est = sketch_distance(sketch_weight(planted), ref)
    assert 0.004 < est < 0.025  # a 1% relative change is seen as about 1%


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_bundle_accepts_a_cast_model_and_refuses_other_weights(fp32_setup, dtype):
    _, ckpt, bundle, other = fp32_setup
    model = load_digits(ckpt).to(dtype)
    apply_bundle(model, bundle)  # reference sketch read from the bundle's source checkpoint
    assert set(plate_layers(model)) == set(BACKBONE)
    for m in BACKBONE:  # the geometry digest is the bundle's, whatever dtype the layer holds Q in
        assert plate_layers(model)[m].geometry_digest == geometry_digest(bundle.b_idx(m), bundle.q(m))
    with pytest.raises(BundleError, match="fingerprint"):
        apply_bundle(copy.deepcopy(other).to(dtype), bundle)
    # a fine-tune-like change of 3% relative, then cast: refused (rounding alone moves < 2u = 0.8% for bf16)
    changed = load_digits(ckpt)
    with torch.no_grad():
        w = changed.fc2.weight
        w.add_(0.03 * w.norm() / w.numel() ** 0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(BundleError, match="module 'fc2'.*differs by about"):
        apply_bundle(changed.to(dtype), bundle)
    # the exact check stays exact in the stored dtype: a tiny change of a float32 model is refused
    tiny = load_digits(ckpt)
    with torch.no_grad():
        tiny.fc1.weight[0, 0] += 1e-6
    with pytest.raises(BundleError, match="module 'fc1'.*fingerprint"):
        apply_bundle(tiny, bundle)


def test_saved_adapter_loads_into_a_cast_model_without_the_source(fp32_setup, tmp_path):
    _, ckpt, bundle, other = fp32_setup
    bundle = _without_source(bundle, tmp_path / "bundle")
    model = load_digits(ckpt)
    randomize_adapters(apply_bundle(model, bundle), seed=2, scale=0.1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    out = model(x).detach()
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    with pytest.raises(BundleError, match="neither an adapter nor the bundle's source"):
        apply_bundle(load_digits(ckpt).to(torch.bfloat16), bundle)
    cast = load_digits(ckpt).to(torch.bfloat16)
    load_adapter(cast, path)  # reference sketch from the adapter
    torch.testing.assert_close(cast(x.bfloat16()).float(), out, rtol=0.05, atol=0.05)
    with pytest.raises(BundleError, match="fingerprint"):
        load_adapter(copy.deepcopy(other).to(torch.bfloat16), path)


def test_adapter_digest_does_not_depend_on_q_in_memory_dtype(fp32_setup, tmp_path):
    _, ckpt, bundle, _ = fp32_setup
    model = load_digits(ckpt)
    randomize_adapters(apply_bundle(model, bundle), seed=5, scale=0.1)
    model.to(torch.bfloat16)  # rounds A, Q and the weights in memory
    assert plate_layers(model)["fc1"].plate_Q.dtype == torch.bfloat16
    path = save_adapter(model, tmp_path / "adapter_bf16.safetensors")
    fresh = load_digits(ckpt)
    load_adapter(fresh, path)  # float32 model, float32 Q from the bundle: same digests
    q16 = bundle.q("fc1").to(torch.bfloat16)
    assert geometry_digest(bundle.b_idx("fc1"), q16) == geometry_digest(bundle.b_idx("fc1"), q16.float())


def test_peft_get_peft_model_and_from_pretrained_on_a_cast_model(fp32_setup, tmp_path):
    _, ckpt, bundle, other = fp32_setup
    pm = get_peft_model(load_digits(ckpt).to(torch.bfloat16), PlateConfig(bundle=str(bundle.path)))
    assert sum(p.numel() for p in pm.parameters() if p.requires_grad) == sum(rec.r * rec.k for rec in bundle)
    bundle = _without_source(bundle, tmp_path / "bundle")
    pm32 = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path)))
    randomize_adapters([p for p in pm32.parameters() if p.requires_grad], seed=6, scale=0.1)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    out = pm32(x).detach()
    pm32.save_pretrained(tmp_path / "peft_adapter")
    cast = load_digits(ckpt).to(torch.bfloat16)
    loaded = PeftModel.from_pretrained(cast, tmp_path / "peft_adapter")  # reference sketch from adapter_config.json
    torch.testing.assert_close(loaded(x.bfloat16()).float(), out, rtol=0.05, atol=0.05)
    with pytest.raises(BundleError, match="fingerprint"):
        PeftModel.from_pretrained(copy.deepcopy(other).to(torch.bfloat16), tmp_path / "peft_adapter")


def test_cast_model_with_prefixed_module_names(tmp_path):
    """A bf16 GPT2LMHeadModel (modules ``transformer.h.0...``) over a float32 GPT-2 checkpoint (``h.0...``): the
    rounded-copy check looks the source weight up by the bundle's name, not the model's (it raised before)."""
    from transformers import GPT2LMHeadModel

    from plate_inspect import scan
    from plate_inspect.testing.synthetic import write_gpt2

    ckpt = write_gpt2(tmp_path / "gpt2", layers=2)
    bundle = scan(ckpt.path, tmp_path / "bundle", r=4, max_rank=16)
    model = GPT2LMHeadModel.from_pretrained(ckpt.path, dtype=torch.bfloat16)
    apply_bundle(model, bundle)
    assert set(plate_layers(model)) == {f"transformer.{m}" for m in bundle.modules}
    other = write_gpt2(tmp_path / "other", layers=2, seed=1)
    with pytest.raises(BundleError, match="fingerprint|differs"):
        apply_bundle(GPT2LMHeadModel.from_pretrained(other.path, dtype=torch.bfloat16), bundle)


def test_bundle_of_an_fp8_checkpoint_applies_to_its_dequantized_weights(tmp_path):
    """QA: a bundle scanned from FP8 storage refused the exactly dequantized model ("made for other weights").
    The dequantized weights (computed here from the codes and block scales) pass in float32 and bfloat16; a 3%
    change is refused; without the source checkpoint the refusal says to keep it."""
    bundle, dequantized, _ = fp8_setup(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        model = model_holding(dequantized).to(dtype)
        apply_bundle(model, bundle)
        assert len(plate_layers(model)) == len(dequantized) == 7
    name = next(iter(dequantized))
    changed = dict(dequantized)
    g = torch.Generator().manual_seed(2)
    w = changed[name]
    changed[name] = w + 0.03 * w.norm() / w.numel() ** 0.5 * torch.randn(w.shape, generator=g)
    with pytest.raises(BundleError, match="differs by about"):
        apply_bundle(model_holding(changed), bundle)
    with pytest.raises(BundleError, match="keep the quantized source checkpoint"):
        apply_bundle(model_holding(dequantized), _without_source(bundle, tmp_path / "moved" / "bundle"))


def test_which_casts_hold_every_stored_value_exactly():
    """Hand-known dtype pairs: only a cast to a dtype with finer mantissa and wider range is exact."""
    from plate_inspect.train.weightcheck import holds_exactly

    assert holds_exactly(torch.float32, torch.bfloat16) and holds_exactly(torch.float32, torch.float16)
    assert all(holds_exactly(d, d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert not holds_exactly(torch.bfloat16, torch.float32) and not holds_exactly(torch.float16, torch.float32)
    assert not holds_exactly(torch.float16, torch.bfloat16)  # finer mantissa, narrower exponent range
    assert not holds_exactly(torch.bfloat16, torch.float16)  # wider range, coarser mantissa


def test_float16_model_of_a_bfloat16_checkpoint_passes_other_weights_do_not(tmp_path):
    """A bf16 checkpoint loaded in float16 (GPUs without bf16): entries below float16's normal range round, so the
    bytes differ, but it is the same model; a 1% change is still refused (float16 resolves 2u = 0.1%)."""
    from plate_inspect.experiments import digits

    _, ckpt32 = digits_checkpoint(tmp_path / "f32", seed=0)
    model = load_digits(ckpt32).to(torch.bfloat16)
    with torch.no_grad():  # planted: values in float16's subnormal range, which a float16 cast rounds
        for m in BACKBONE:
            getattr(model, m).weight[::7, ::5] = 3.3e-7
    (tmp_path / "bf16").mkdir()
    digits.save_model(model, tmp_path / "bf16" / "model.safetensors")
    bundle = digits_bundle(tmp_path / "bf16" / "model.safetensors", tmp_path / "bundle", r=16, tau=0.8)
    fp16 = load_digits(tmp_path / "bf16" / "model.safetensors").to(torch.float16)
    for m in BACKBONE:  # dense oracle: the cast is lossy, and by far less than float16's 2u
        w16, wbf = getattr(fp16, m).weight.double(), getattr(model, m).weight.double()
        rel = float((w16 - wbf).norm() / wbf.norm())
        assert 0 < rel < 2 * 2.0**-11
    randomize_adapters(apply_bundle(fp16, bundle, rho=0.5), seed=2)
    assert set(plate_layers(fp16)) == set(BACKBONE)
    changed = load_digits(tmp_path / "bf16" / "model.safetensors")
    with torch.no_grad():
        w = changed.fc3.weight
        w.add_(0.01 * w.norm() / w.numel() ** 0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(BundleError, match="module 'fc3'.*differs by about"):
        apply_bundle(changed.to(torch.float16), bundle)
