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
)
from peft import PeftModel, get_peft_model
from torch import nn

import plate_inspect.train.peft as plate_peft
from plate_inspect import scan
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.train.peft import PlateConfig, PlateLayer


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
    with pytest.raises(
        BundleError, match=r"another bundle \(module 'fc1': the adapter has r = 16, k = \d+, the bundle r = 8"
    ):
        PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")


def test_lean_adapter_whose_bundle_moved_says_how_to_point_at_it(digits_setup, tmp_path):
    """A moved bundle: one line naming the recorded path and the config override; the override reproduces the
    dense oracle W + rho B A Q^T."""
    import shutil

    _, ckpt, bundle = digits_setup
    own = tmp_path / "bundle"
    shutil.copytree(bundle.path, own)
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(own), rho=0.5))
    g = torch.Generator().manual_seed(7)
    a_s = {}
    with torch.no_grad():
        for m in BACKBONE:
            a = getattr(pm.base_model.model, m).plate_A["default"]
            a.copy_(torch.randn(a.shape, generator=g) * 0.3)
            a_s[m] = a.detach().clone()
    pm.save_pretrained(tmp_path / "adapter")
    shutil.move(own, tmp_path / "moved")
    with pytest.raises(BundleError, match=r"bundle: the bundle this adapter was made with is not there.*config=config"):
        PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    config = PlateConfig.from_pretrained(tmp_path / "adapter")
    config.bundle = str(tmp_path / "moved")
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter", config=config)
    base = load_digits(ckpt)
    x = torch.randn(5, 64, generator=g)
    h = x.double()
    for m in BACKBONE:  # DigitsMLP.features: relu(fc3(relu(fc2(relu(fc1(x))))))
        w = dense_plate_weight(getattr(base, m).weight.detach(), bundle.b_idx(m), a_s[m], bundle.q(m), 0.5)
        h = h @ w.T + getattr(base, m).bias.detach().double()
        h = torch.relu(h)
    torch.testing.assert_close(loaded.base_model.model.features(x).double(), h, rtol=1e-5, atol=1e-5)


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


def test_reentrant_checkpointing_switched_on_after_get_peft_model_trains_a(tiny_qwen):
    """use_reentrant=True (transformers 4.x's default) with the whole base model frozen, switched on through the
    PeftModel as the Trainer does: A gets the gradients of the same model run without checkpointing, with or without
    its embeddings' output requiring grad (equal up to float32 rounding of the backward's sums), and the decoder
    layers really ran twice (forward, then the recompute)."""
    from transformers import AutoModelForCausalLM

    root, bundle = tiny_qwen
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))

    def a_grads(mode: str) -> tuple[dict[str, torch.Tensor], int]:
        model = AutoModelForCausalLM.from_pretrained(root / "model")
        pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), task_type="CAUSAL_LM"))
        trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
        helpers_train.randomize_adapters(trainable.values(), seed=4, scale=0.05)
        calls = []
        pm.base_model.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
        if mode == "checkpointed":  # transformers 5 names it activation_*, 4.x gradient_*
            name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
            getattr(pm, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": True}})
            assert model.model.gradient_checkpointing
        elif mode == "input grads":
            model.enable_input_require_grads()
        pm.train()
        pm(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for p in trainable.values()), mode
        return {n: p.grad.clone() for n, p in trainable.items()}, len(calls)

    plain, plain_calls = a_grads("plain")
    same_inputs, _ = a_grads("input grads")
    checkpointed, ckpt_calls = a_grads("checkpointed")
    assert len(plain) == 14 and (plain_calls, ckpt_calls) == (1, 2)
    for n, g in plain.items():
        assert g.abs().sum() > 0, n
        for oracle in (g, same_inputs[n]):  # 4.56.2: 4e-7 of the largest (rounding); 5.23: bit for bit
            assert (checkpointed[n] - oracle).abs().max() <= 2e-6 * oracle.abs().max(), n


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
    with pytest.raises(BundleError, match="fingerprint differs.*load it onto the base model it was made for"):
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
    with pytest.raises(BundleError, match=r"no_bundle_here: the bundle this adapter was made with is not there"):
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


def _randomize(modules, seed: int, scale: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in modules:
            for p in layer.plate_A.values():
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _dense_digits(ckpt, bundle, a_by_module: dict[str, torch.Tensor], rho: float) -> nn.Module:
    """The digits model with W + rho E_B A Q^T written into the given modules (float64 oracle, rounded once)."""
    model = load_digits(ckpt)
    with torch.no_grad():
        for m, a in a_by_module.items():
            layer = getattr(model, m)
            layer.weight.copy_(dense_plate_weight(layer.weight.detach(), bundle.b_idx(m), a, bundle.q(m), rho).float())
    return model


def test_second_plate_adapter_add_switch_save_and_load(digits_setup, tmp_path):
    from safetensors.torch import load_file

    _, ckpt, bundle = digits_setup
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), rho=0.5))
    two = PlateConfig(bundle=str(bundle.path), rho=0.25, target_modules=["fc2"], carry_geometry=True)
    pm.add_adapter("two", two)
    layers = {m: getattr(pm.base_model.model, m) for m in BACKBONE}
    assert set(layers["fc2"].plate_A) == {"default", "two"} and set(layers["fc1"].plate_A) == {"default"}
    _randomize(layers.values(), seed=5)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    a = {
        name: {m: l.plate_A[name].detach() for m, l in layers.items() if name in l.plate_A}
        for name in ("default", "two")
    }
    out_default = pm(x).detach()
    torch.testing.assert_close(out_default, _dense_digits(ckpt, bundle, a["default"], 0.5)(x), rtol=1e-5, atol=1e-5)
    pm.set_adapter("two")
    out_two = pm(x).detach()
    torch.testing.assert_close(out_two, _dense_digits(ckpt, bundle, a["two"], 0.25)(x), rtol=1e-5, atol=1e-5)
    assert {n for n, p in pm.named_parameters() if p.requires_grad} == {"base_model.model.fc2.plate_A.two"}
    pm.save_pretrained(tmp_path / "adapters")
    lean = load_file(str(tmp_path / "adapters" / "adapter_model.safetensors"))
    assert {k.rsplit(".", 1)[-1] for k in lean} == {"plate_A"}  # the lean adapter stays lean beside a carrying one
    carried = load_file(str(tmp_path / "adapters" / "two" / "adapter_model.safetensors"))
    assert set(carried) == {f"base_model.model.fc2.{t}" for t in ("plate_A", "plate_B_idx", "plate_Q")}
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapters")
    loaded.load_adapter(tmp_path / "adapters" / "two", adapter_name="two")
    loaded.load_adapter(tmp_path / "adapters", adapter_name="again")
    assert torch.equal(loaded(x), out_default)
    loaded.set_adapter("two")
    assert torch.equal(loaded(x), out_two)
    loaded.set_adapter("again")
    assert torch.equal(loaded(x), out_default)
    loaded.merge_adapter()
    with pytest.raises(ConfigError, match="unmerge_adapter"):
        loaded.add_adapter("three", PlateConfig(bundle=str(bundle.path)))


def test_carrying_adapter_loads_into_a_cast_base_and_edits_are_refused(digits_setup, tmp_path):
    """The carried B/Q are checked as saved (before the cast to the model's dtype); Q is then the bundle's Q rounded
    once to the model's dtype, whichever dtype the adapter was trained in."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, ckpt, bundle = digits_setup
    own = tmp_path / "bundle"
    shutil.copytree(bundle.path, own)
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(own), carry_geometry=True))
    _randomize([m for m in pm.modules() if isinstance(m, PlateLayer)], seed=7)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    out = pm(x).detach()
    pm.save_pretrained(tmp_path / "fp32")
    shutil.rmtree(own)  # the use case: the bundle is not on the serving machine
    for dtype in (torch.bfloat16, torch.float16):
        loaded = PeftModel.from_pretrained(load_digits(ckpt).to(dtype), tmp_path / "fp32")
        q = loaded.base_model.model.fc1.plate_Q["default"]
        assert q.dtype == dtype and torch.equal(q, bundle.q("fc1").to(dtype))
        torch.testing.assert_close(loaded(x.to(dtype)).float(), out, rtol=0.05, atol=0.05)
    pm16 = get_peft_model(
        load_digits(ckpt).to(torch.bfloat16), PlateConfig(bundle=str(bundle.path), carry_geometry=True)
    )
    pm16.save_pretrained(tmp_path / "bf16")
    up = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "bf16")  # served on the float32 original
    assert torch.equal(up.base_model.model.fc1.plate_Q["default"], bundle.q("fc1").to(torch.bfloat16).float())
    stored = load_file(str(tmp_path / "fp32" / "adapter_model.safetensors"))
    key = "base_model.model.fc2.plate_Q"
    for label, edit, match in [
        ("flipped", lambda sd: sd.update({key: sd[key].flip(1).contiguous()}), "fc2.*carried B/Q differ"),
        ("missing", lambda sd: sd.pop(key), "lacks 'base_model.model.fc2.plate_Q.default'"),
    ]:
        shutil.copytree(tmp_path / "fp32", tmp_path / label)
        sd = dict(stored)
        edit(sd)
        save_file(sd, str(tmp_path / label / "adapter_model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(BundleError, match=match):
            PeftModel.from_pretrained(load_digits(ckpt).to(torch.bfloat16), tmp_path / label)


def test_carrying_adapter_ignores_another_scan_at_its_bundle_path(digits_setup, tmp_path):
    _, ckpt, _ = digits_setup
    bpath = tmp_path / "bundle"
    b = digits_bundle(ckpt, bpath, r=16, tau=0.8)
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(b.path), carry_geometry=True))
    _randomize([m for m in pm.modules() if isinstance(m, PlateLayer)], seed=9)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10))
    out = pm(x).detach()
    pm.save_pretrained(tmp_path / "adapter")
    digits_bundle(ckpt, bpath, r=8, tau=0.8)  # the same directory now holds another scan
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    assert torch.equal(loaded(x), out)


def test_target_modules_lists_regex_strings_all_linear_and_bundle_names(tiny_qwen):
    from transformers import AutoModel, AutoModelForCausalLM

    root, bundle = tiny_qwen

    def wrapped(model, target_modules):
        pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), target_modules=target_modules))
        return sorted(n.removeprefix("base_model.model.") for n, m in pm.named_modules() if isinstance(m, PlateLayer))

    def causal():
        return AutoModelForCausalLM.from_pretrained(root / "model")

    q_projs = [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    assert wrapped(causal(), r".*\.q_proj") == q_projs  # a string is a full-match regex, as in peft
    assert len(wrapped(causal(), "all-linear")) == len(bundle)
    with pytest.warns(UserWarning, match=r"\['lm_head'\] match no module of the bundle"):
        assert wrapped(causal(), ["q_proj", "lm_head"]) == q_projs
    with pytest.raises(
        BundleError,
        match=r"regular expression matching whole names.*target_modules=\['q_proj'\]|"
        r"target_modules=\['q_proj'\].*regular expression matching whole names",
    ):
        wrapped(causal(), "q_proj")
    # the bundle's own (checkpoint) names select modules of a bare Qwen2Model, whose names lack "model."
    assert wrapped(AutoModel.from_pretrained(root / "model"), [q_projs[0]]) == ["layers.0.self_attn.q_proj"]
    with pytest.raises(ConfigError, match="target_modules must be a list"):
        PlateConfig(bundle=str(bundle.path), target_modules=3)
    with pytest.raises(ConfigError, match="regular expression"):
        PlateConfig(bundle=str(bundle.path), target_modules="(q_proj")


@pytest.mark.parametrize("rho", [float("nan"), float("inf"), 0, -1.0, "a", None, True])
def test_plate_config_rho_is_validated(digits_setup, rho):
    _, _, bundle = digits_setup
    with pytest.raises(ConfigError, match="rho must be a positive finite number"):
        PlateConfig(bundle=str(bundle.path), rho=rho)


def test_peft_adapter_given_to_load_adapter_or_merge_says_what_to_use(digits_setup, tmp_path):
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli
    from plate_inspect.train.layer import load_adapter

    _, ckpt, bundle = digits_setup
    get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path))).save_pretrained(tmp_path / "peft")
    for given in (tmp_path / "peft", tmp_path / "peft" / "adapter_model.safetensors"):
        with pytest.raises(BundleError, match="PEFT adapter.*PeftModel.from_pretrained.*merge_and_unload"):
            load_adapter(load_digits(ckpt), given)
        res = CliRunner().invoke(cli, ["merge", str(ckpt), str(given), "-o", str(tmp_path / "merged")])
        assert res.exit_code == 2 and "merge_and_unload" in res.output and "Traceback" not in res.output


def test_mixing_apply_bundle_and_the_peft_method_is_refused_in_one_line(digits_setup):
    """A model wrapped by one PLATE route is refused by the other, naming the module and how to undo it."""
    from plate_inspect.train.layer import apply_bundle

    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    with pytest.raises(BundleError, match=r"module 'fc1' is already wrapped \(PlateLinear\).*unload\(model\)"):
        get_peft_model(model, PlateConfig(bundle=str(bundle.path)))
    pm = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path)))
    with pytest.raises(
        BundleError, match=r"'base_model.model.fc1' is already wrapped \(PlateLayer\).*merge_and_unload"
    ):
        apply_bundle(pm, bundle)


def test_moe_checkpoint_experts_wrapped_or_refused_as_the_model_holds_them(tmp_path):
    """Mixtral's checkpoint stores per-expert w1/w2/w3. transformers 4.x holds them as those nn.Linears (same names,
    same [d_out, d_in]): every bundle module is wrapped and the MoE block's output and A gradients equal a dense
    float64 oracle (router top-2 of softmax, renormalised; sum over the chosen experts of
    w2'(silu(w1' x) * w3' x), each W' = W + rho E_B A Q^T). transformers 5 fuses them into 3-D parameters: every
    expert is adapted inside them (PlateExpertsLayer). Attention-only targets work in both (dense oracle)."""
    from transformers import AutoModelForCausalLM

    from plate_inspect.testing.synthetic import write_family

    write_family(tmp_path / "model", "mixtral", dtype=torch.float32)
    bundle = scan(tmp_path / "model", tmp_path / "bundle", r=4, tau=0.9, max_rank=16)
    assert any(".experts.0.w1" in m for m in bundle.modules)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    held = dict(model.named_modules())
    if all(isinstance(held.get(m), nn.Linear) for m in bundle.modules):  # transformers 4.x
        _check_moe_block_against_dense_oracle(model, bundle, "model.layers.1.block_sparse_moe")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    else:  # transformers 5: the experts are fused parameters, not modules; each is adapted inside them
        from plate_inspect.train.peft import PlateExpertsLayer  # (tests/train/test_fused_experts.py: the oracle)

        assert not any(".experts.0.w1" in n for n in held)
        whole = get_peft_model(model, PlateConfig(bundle=str(bundle.path)))
        fused = [m for m in whole.modules() if isinstance(m, PlateExpertsLayer)]
        adapted = {s.bundle_name for m in fused for s in m.plate_slots["default"].values()}
        assert adapted == {m for m in bundle.modules if ".experts." in m} and len(fused) == 2
        model = whole.unload()
    pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), target_modules=["q_proj"], rho=0.5))
    name = "model.layers.1.self_attn.q_proj"
    assert pm.peft_config["default"].target_modules == {"model.layers.0.self_attn.q_proj", name}
    layer = pm.base_model.model.get_submodule(name)
    with torch.no_grad():
        layer.plate_A["default"].normal_(generator=torch.Generator().manual_seed(0))
    a = layer.plate_A["default"].detach()
    w = dense_plate_weight(layer.base_layer.weight.detach(), bundle.b_idx(name), a, bundle.q(name), 0.5)
    x = torch.randn(6, w.shape[1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x).double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)


def _check_moe_block_against_dense_oracle(model: nn.Module, bundle, moe_name: str) -> None:
    """Wrap every bundle module of a per-expert-Linear Mixtral; one MoE block's output and its experts' A gradients
    against float64 autograd through the dense weights W + rho E_B A Q^T."""
    rho = 0.5
    pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), rho=rho))
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if isinstance(m, PlateLayer)}
    assert set(layers) == set(bundle.modules) and len(layers) == 26  # 3 experts x 3 + 4 attention, 2 layers
    helpers_train.randomize_adapters([m.plate_A["default"] for m in layers.values()], seed=2, scale=0.2)
    moe = pm.base_model.model.get_submodule(moe_name)
    n_experts, hidden = len(moe.experts), moe.gate.weight.shape[1]
    x = torch.randn(1, 16, hidden, generator=torch.Generator().manual_seed(3))
    probe = torch.randn(16, hidden, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = moe(x)[0].reshape(16, hidden)  # 4.x returns (hidden states, router logits)
    (out.double() * probe).sum().backward()

    h = x.reshape(16, hidden).double()
    probs = torch.softmax(h @ moe.gate.weight.detach().double().T, dim=-1)
    top_p, top_e = probs.topk(2, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    a64, w = {}, {}
    for e in range(n_experts):
        for proj in ("w1", "w2", "w3"):
            name = f"{moe_name}.experts.{e}.{proj}"
            a64[name] = layers[name].plate_A["default"].detach().double().requires_grad_()
            base = layers[name].base_layer.weight.detach()
            w[e, proj] = dense_plate_weight(base, bundle.b_idx(name), a64[name], bundle.q(name), rho)
    oracle = torch.zeros(16, hidden, dtype=torch.float64)
    for t in range(16):
        for p, e in zip(top_p[t], top_e[t].tolist(), strict=True):
            act = torch.nn.functional.silu(w[e, "w1"] @ h[t]) * (w[e, "w3"] @ h[t])
            oracle[t] = oracle[t] + p * (w[e, "w2"] @ act)
    (oracle * probe).sum().backward()
    assert len(set(top_e.flatten().tolist())) == n_experts  # every expert is used, so each has a gradient to check
    torch.testing.assert_close(out.double(), oracle.detach(), rtol=1e-5, atol=1e-6)
    for name, a in a64.items():
        assert a.grad.abs().sum() > 0, name
        torch.testing.assert_close(layers[name].plate_A["default"].grad.double(), a.grad, rtol=1e-4, atol=1e-6)


def test_transformers_adapter_integration(tiny_qwen, tmp_path):
    """transformers' own adapter API (PeftAdapterMixin) with PLATE: add_adapter, load_adapter, and from_pretrained of
    an adapter directory give the PeftModel's outputs; the weight check holds there too."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    root, bundle = tiny_qwen
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"), PlateConfig(bundle=str(bundle.path)))
    _randomize([m for m in pm.modules() if isinstance(m, PlateLayer)], seed=7)
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    pm.save_pretrained(tmp_path / "adapter")

    added = AutoModelForCausalLM.from_pretrained(root / "model")
    added.add_adapter(PlateConfig(bundle=str(bundle.path)))
    trainable = sum(p.numel() for p in added.parameters() if p.requires_grad)
    assert trainable == sum(bundle.record(m).r * bundle.record(m).k for m in bundle.modules)
    loaded = AutoModelForCausalLM.from_pretrained(root / "model")
    loaded.load_adapter(str(tmp_path / "adapter"))
    direct = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")  # the adapter config names the base model
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(direct(input_ids=ids).logits, want, rtol=0, atol=0)

    state = load_file(str(root / "model" / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.01
    (tmp_path / "other").mkdir()
    save_file(state, str(tmp_path / "other" / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (root / "model" / name).exists():
            (tmp_path / "other" / name).write_bytes((root / "model" / name).read_bytes())
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "other")
    with pytest.raises(BundleError, match=r"module 'model.layers.1.mlp.down_proj'.*other base weights"):
        other.load_adapter(str(tmp_path / "adapter"))


def test_trainer_resumes_from_a_checkpoint_exactly(tiny_qwen, tmp_path):
    """Nothing lost on a crash: a run stopped after its step-2 checkpoint and resumed (resume_from_checkpoint) ends
    with the A's and losses of the uninterrupted run, bit for bit."""
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    root, bundle = tiny_qwen
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids} for _ in range(16)]

    class StopAtFirstSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            control.should_training_stop = True

    def run(out, stop=False, resume=False):
        model = AutoModelForCausalLM.from_pretrained(root / "model")
        pm = get_peft_model(model, PlateConfig(bundle=str(bundle.path), task_type="CAUSAL_LM"))
        args = TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=4,
            max_steps=4,
            learning_rate=1e-2,
            report_to=[],
            save_strategy="steps",
            save_steps=2,
            use_cpu=True,
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=pm, args=args, train_dataset=data, callbacks=[StopAtFirstSave()] if stop else [])
        trainer.train(resume_from_checkpoint=resume or None)
        a = {n: p.detach().clone() for n, p in pm.named_parameters() if "plate_A" in n}
        return a, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    whole, whole_losses = run(tmp_path / "whole")
    _, first = run(tmp_path / "crashed", stop=True)
    assert len(first) == 2 and (tmp_path / "crashed" / "checkpoint-2" / "adapter_model.safetensors").exists()
    resumed, losses = run(tmp_path / "crashed", resume=True)
    assert losses == whole_losses
    assert resumed.keys() == whole.keys() and len(whole) == 14
    for n, a in whole.items():
        assert torch.equal(resumed[n], a), n
