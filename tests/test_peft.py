"""The ``plate`` PEFT method: get_peft_model, trainable counts, save/load, merge_and_unload, Trainer, refusals."""

from __future__ import annotations

import helpers_train
import pytest
import torch
from helpers_train import (
    BACKBONE,
    dense_plate_weight,
    digits_bundle,
    digits_checkpoint,
    load_digits,
    save_tiny_qwen2,
)
from peft import PeftModel, get_peft_model
from torch import nn

import plate_inspect.train.peft as plate_peft
from plate_inspect import scan
from plate_inspect.errors import BundleError
from plate_inspect.train.peft import PlateConfig, PlateLayer


@pytest.fixture(scope="module")
def digits_setup(tmp_path_factory):
    return helpers_train.digits_setup(tmp_path_factory.mktemp("peft_digits"))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A randomly initialised tiny Qwen2ForCausalLM saved with save_pretrained (safetensors) and scanned."""
    root = tmp_path_factory.mktemp("tiny_qwen")
    save_tiny_qwen2(root / "model")
    bundle = scan(root / "model", root / "bundle", r=4, tau=0.8, max_rank=16, overwrite=True)
    return root, bundle


def test_registered_as_peft_method():
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    assert PEFT_TYPE_TO_CONFIG_MAPPING["PLATE"] is PlateConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING["PLATE"] is plate_peft.PlateModel
    with pytest.raises(BundleError, match="needs bundle"):
        PlateConfig()


def test_digits_get_peft_model_counts_save_load_merge(digits_setup, tmp_path, capsys):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    ref = model(x).detach()
    pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), rho=0.5))
    assert torch.equal(pm(x), ref)  # zero-initialised A
    expected = sum(bundle.record(m).r * bundle.record(m).k for m in BACKBONE)
    trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == expected
    assert all("plate_A" in n for n in trainable)
    pm.print_trainable_parameters()
    assert f"trainable params: {expected:,}" in capsys.readouterr().out
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable.values():
            p.copy_(torch.randn(p.shape, generator=g))
    out = pm(x).detach()
    pm.save_pretrained(tmp_path / "adapter")
    saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert keys == {f"base_model.model.{m}.plate_A" for m in BACKBONE}  # only A is stored; B and Q come from the bundle
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    assert torch.equal(loaded(x), out)
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, PlateLayer)}
    a_s = {n.split(".")[-1]: m.plate_A["default"].detach() for n, m in layers.items()}
    merged = loaded.merge_and_unload()
    assert all(type(getattr(merged, m)) is nn.Linear for m in BACKBONE)
    torch.testing.assert_close(merged(x), out, rtol=1e-5, atol=1e-5)
    base = load_digits(ckpt)
    for m in BACKBONE:
        expect = dense_plate_weight(getattr(base, m).weight.detach(), bundle.b_idx(m), a_s[m], bundle.q(m), 0.5)
        torch.testing.assert_close(getattr(merged, m).weight.double(), expect, rtol=0, atol=1e-5)


def test_exact_unmerge_and_target_subset(digits_setup):
    _, ckpt, bundle = digits_setup
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), target_modules=["fc2"]))
    wrapped = [n for n, m in pm.named_modules() if isinstance(m, PlateLayer)]
    assert [n.split(".")[-1] for n in wrapped] == ["fc2"]
    layer = pm.base_model.model.fc2
    with torch.no_grad():
        layer.plate_A["default"].normal_()
    w0 = layer.base_layer.weight.detach().clone()
    x = torch.randn(4, 64)
    out = pm(x).detach()
    pm.merge_adapter()
    assert not torch.equal(layer.base_layer.weight, w0)
    torch.testing.assert_close(pm(x), out, rtol=1e-5, atol=1e-5)
    pm.unmerge_adapter()
    assert torch.equal(layer.base_layer.weight, w0)
    with pytest.raises(BundleError, match="match none"):
        get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), target_modules=["head1"]))


def test_mismatched_bundle_or_weights_refused(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    other, _ = digits_checkpoint(tmp_path / "other", seed=3)
    with pytest.raises(BundleError, match="fingerprint"):
        get_peft_model(other, PlateConfig(bundle=str(bundle.path)))
    # an adapter saved against one bundle is refused when the bundle on disk changed
    bpath = tmp_path / "bundle"
    b = digits_bundle(ckpt, bpath, r=16, tau=0.8)
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(b.path)))
    pm.save_pretrained(tmp_path / "adapter")
    digits_bundle(ckpt, bpath, r=8, tau=0.8)  # rescanned with other settings at the same path
    with pytest.raises(BundleError, match="another bundle"):
        PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")


def test_trainer_on_tiny_qwen2_with_gradient_checkpointing(tiny_qwen, tmp_path):
    import dataclasses

    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    # transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name goes in v6)
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"

    root, bundle = tiny_qwen
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), task_type="CAUSAL_LM"))
    n_layers = sum(isinstance(m, PlateLayer) for m in pm.modules())
    assert n_layers == len(bundle) == 14
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids} for _ in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        **{checkpointing: True},
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = Trainer(model=pm, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == 4
    assert pm.get_base_model().model.gradient_checkpointing  # the decoder really ran with checkpointing
    for n, p in pm.named_parameters():
        if "plate_A" in n:
            assert p.abs().sum() > 0, n  # A moved away from zero
    for n, p in pm.get_base_model().named_parameters():
        if "plate_A" not in n:
            key = n.replace(".base_layer", "")
            assert torch.equal(p, base_before[key]), n  # everything else frozen
    pm.save_pretrained(tmp_path / "adapter")
    x = data[0]["input_ids"][None]
    pm.eval()
    with torch.no_grad():
        out = pm(input_ids=x).logits
    fresh = AutoModelForCausalLM.from_pretrained(root / "model")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, out)
        merged = loaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=x).logits, out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
def test_carried_q_stays_in_a_bf16_models_dtype(digits_setup, tmp_path, autocast_adapter_dtype):
    """peft upcasts adapter tensors to float32 by default; the carried Q stays bf16 (half the file), A is float32,
    and the saved adapter reloads on a bf16 model to the same outputs."""
    from safetensors.torch import load_file

    _, ckpt, bundle = digits_setup
    cfg = PlateConfig(bundle=str(bundle.path), carry_geometry=True)
    pm = get_peft_model(load_digits(ckpt).to(torch.bfloat16), cfg, autocast_adapter_dtype=autocast_adapter_dtype)
    layer = pm.base_model.model.fc1
    assert layer.plate_Q["default"].dtype == torch.bfloat16
    assert layer.plate_A["default"].dtype == torch.float32  # peft's model creation keeps A in float32
    assert torch.equal(layer.plate_Q["default"], bundle.q("fc1").to(torch.bfloat16))
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    x = torch.randn(4, 64).to(torch.bfloat16)
    out = pm(x).detach()
    pm.save_pretrained(tmp_path / "adapter")
    stored = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert {stored[f"base_model.model.{m}.plate_Q"].dtype for m in BACKBONE} == {torch.bfloat16}
    loaded = PeftModel.from_pretrained(load_digits(ckpt).to(torch.bfloat16), tmp_path / "adapter")
    assert loaded.base_model.model.fc1.plate_Q["default"].dtype == torch.bfloat16
    torch.testing.assert_close(loaded(x), out, rtol=0, atol=0)


def test_adapter_carrying_b_and_q_loads_without_the_bundle(digits_setup, tmp_path):
    import shutil

    from safetensors.torch import load_file

    _, ckpt, bundle = digits_setup
    own = tmp_path / "bundle"
    shutil.copytree(bundle.path, own)
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(own), carry_geometry=True))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(5, 64, generator=g)
    out = pm(x).detach()
    pm.save_pretrained(tmp_path / "adapter")
    stored = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for m in BACKBONE:
        assert torch.equal(stored[f"base_model.model.{m}.plate_B_idx"], bundle.b_idx(m))
        assert stored[f"base_model.model.{m}.plate_Q"].dtype == torch.float32  # the model's dtype
        assert torch.equal(stored[f"base_model.model.{m}.plate_Q"], bundle.q(m))
    shutil.rmtree(own)  # the bundle is not on this machine
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    torch.testing.assert_close(loaded(x), out, rtol=0, atol=0)
    other, _ = digits_checkpoint(tmp_path / "other", seed=5)
    with pytest.raises(BundleError, match="fingerprint"):
        PeftModel.from_pretrained(other, tmp_path / "adapter")
    # a lean adapter (the default) needs its bundle, and says so
    lean = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path)))
    lean.save_pretrained(tmp_path / "lean")
    keys = set(load_file(str(tmp_path / "lean" / "adapter_model.safetensors")))
    assert keys == {f"base_model.model.{m}.plate_A" for m in BACKBONE}
    import json

    cfg = json.loads((tmp_path / "lean" / "adapter_config.json").read_text())
    cfg["bundle"] = str(tmp_path / "no_bundle_here")
    (tmp_path / "lean" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(BundleError, match="no_bundle_here: does not exist"):
        PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "lean")


def test_merged_model_loads_as_plain_transformers_checkpoint(tiny_qwen, tmp_path):
    """merge_and_unload + save_pretrained: AutoModelForCausalLM loads it in a process without plate_inspect."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    root, bundle = tiny_qwen
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"), PlateConfig(bundle=str(bundle.path)))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    with torch.no_grad():
        adapter_logits = pm(input_ids=ids).logits
    merged = pm.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    torch.save({"ids": ids}, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'merged')!r})\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})['ids']\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(input_ids=ids).logits, {str(tmp_path / 'logits.pt')!r})\n"
        "assert not any(k.startswith('plate_inspect') or k == 'peft' for k in sys.modules), 'imported plate/peft'\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), adapter_logits, rtol=1e-4, atol=1e-4)
