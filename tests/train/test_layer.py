"""PlateLinear and apply_bundle against dense oracles: gradients, init, merge, dtypes, checkpointing, adapters."""

from __future__ import annotations

import pytest
import torch
from helpers_train import (
    BACKBONE,
    dense_plate_weight,
    digits_bundle,
    digits_checkpoint,
    load_digits,
    randomize_adapters,
)
from torch import nn

from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.geometry import random_orthonormal, random_rows
from plate_inspect.train.layer import (
    PlateLinear,
    apply_bundle,
    load_adapter,
    merge_all,
    plate_layers,
    save_adapter,
    unload,
    unmerge_all,
)
from plate_inspect.train.sequential import merge_checkpoint


def _x(n=9, d=64, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def test_only_a_receives_gradients_and_init_is_exact(digits_setup):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    x = _x()
    ref = model(x).detach().clone()
    trainable = apply_bundle(model, bundle)
    assert torch.equal(model(x), ref)  # A = 0: bit-identical output
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {f"{m}.plate_A" for m in BACKBONE}
    assert [tuple(p.shape) for p in trainable] == [(bundle.record(m).r, bundle.record(m).k) for m in BACKBONE]
    assert all(not p.any() for p in trainable)
    model(x, task=1).square().sum().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == n.endswith("plate_A"), n
    assert all(p.grad.abs().sum() > 0 for p in trainable)
    # B is an index buffer, never a dense d_out x r matrix
    layer = model.fc2
    assert layer.plate_B_idx.dtype == torch.int64 and layer.plate_B_idx.ndim == 1
    assert all(b.ndim == 1 or b.shape[0] == layer.d_in for b in layer.buffers() if b is not None)


def test_forward_and_merge_match_dense_oracle(digits_setup):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    w0 = {m: getattr(model, m).weight.detach().clone() for m in BACKBONE}
    trainable = apply_bundle(model, bundle, rho=0.5)
    randomize_adapters(trainable, seed=3)
    x = _x()
    # oracle: the same MLP with dense W + rho E_B A Q^T, float64
    h = x.double()
    for m in BACKBONE:
        layer = getattr(model, m)
        w = dense_plate_weight(w0[m], layer.plate_B_idx, layer.plate_A.detach(), layer.plate_Q, 0.5)
        h = torch.relu(h @ w.T + layer.bias.double())
    oracle = h @ model.head1.weight.double().T + model.head1.bias.double()
    out = model(x)
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)
    merge_all(model)
    for m in BACKBONE:
        layer = getattr(model, m)
        expect = dense_plate_weight(w0[m], layer.plate_B_idx, layer.plate_A.detach(), layer.plate_Q, 0.5)
        torch.testing.assert_close(layer.base.weight.double(), expect, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-6)
    unmerge_all(model)
    for m in BACKBONE:
        assert torch.equal(getattr(model, m).base.weight, w0[m])  # exact restore
    torch.testing.assert_close(model(x), out, rtol=0, atol=0)
    plain = unload(model)
    assert isinstance(plain.fc1, nn.Linear)
    torch.testing.assert_close(plain(x), out, rtol=1e-5, atol=1e-6)


def test_conv1d_orientation_against_oracle():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    d_in, d_out, r, k = 12, 20, 5, 4
    conv = Conv1D(d_out, d_in)  # weight stored [d_in, d_out]
    nn.init.normal_(conv.bias)
    w_stored = conv.weight.detach().clone()
    b_idx, q = random_rows(d_out, r, 1), random_orthonormal(d_in, k, 2)
    layer = PlateLinear(conv, b_idx, q, rho=0.5)
    assert (layer.d_out, layer.d_in, layer.layout) == (d_out, d_in, "conv1d")
    randomize_adapters([layer.plate_A], seed=4)
    x = torch.randn(3, 7, d_in)
    w = dense_plate_weight(w_stored.T, b_idx, layer.plate_A.detach(), q, 0.5)  # oriented [d_out, d_in]
    oracle = x.double() @ w.T + conv.bias.double()
    torch.testing.assert_close(layer(x).double(), oracle, rtol=1e-5, atol=1e-5)
    layer.merge()
    torch.testing.assert_close(conv.weight.double(), w.T, rtol=0, atol=1e-6)  # columns B changed, layout kept
    untouched = torch.ones(d_out, dtype=torch.bool)
    untouched[b_idx] = False
    assert torch.equal(conv.weight[:, untouched], w_stored[:, untouched])
    layer.unmerge()
    assert torch.equal(conv.weight, w_stored)


def test_bf16_autocast_and_bf16_weights(digits_setup):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    trainable = apply_bundle(model, bundle)
    randomize_adapters(trainable, seed=5, scale=0.1)
    x = _x()
    ref = model(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    out.float().sum().backward()
    assert trainable[0].grad is not None and trainable[0].grad.dtype == torch.float32
    model.to(torch.bfloat16)  # bf16 weights, A and Q, no autocast
    out16 = model(x.to(torch.bfloat16))
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, rtol=0.05, atol=0.05)
    merge_all(model)
    torch.testing.assert_close(model(x.to(torch.bfloat16)).float(), ref, rtol=0.05, atol=0.05)
    w_merged = model.fc2.base.weight.clone()
    unmerge_all(model)
    assert not torch.equal(w_merged, model.fc2.base.weight)
    assert torch.equal(model.fc2.base.weight, load_digits(ckpt).fc2.weight.to(torch.bfloat16))


def test_gradient_checkpointing_gives_same_gradients(digits_setup):
    from torch.utils.checkpoint import checkpoint

    _, ckpt, bundle = digits_setup
    grads = []
    for use_ckpt in (False, True):
        model = load_digits(ckpt)
        trainable = apply_bundle(model, bundle)
        randomize_adapters(trainable, seed=6, scale=0.1)
        x = _x()
        h = checkpoint(model.features, x, use_reentrant=False) if use_ckpt else model.features(x)
        model.head1(h).square().sum().backward()
        grads.append([p.grad.clone() for p in trainable])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_fingerprint_mismatch_is_refused_and_skip_warns(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    other, _ = digits_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(BundleError, match="module 'fc1'.*fingerprint"):
        apply_bundle(other, bundle)
    assert not plate_layers(other)  # nothing wrapped
    with pytest.warns(UserWarning, match="fingerprint check skipped"):
        apply_bundle(other, bundle, check_fingerprints=False)
    assert set(plate_layers(other)) == set(BACKBONE)
    # a model with other shapes is refused even without the fingerprint check
    wide = nn.Module()
    wide.fc1 = nn.Linear(64, 128)
    with pytest.raises(BundleError, match="fc1.*\\[256, 64\\]"), pytest.warns(UserWarning):
        apply_bundle(wide, bundle, modules=["fc1"], check_fingerprints=False)


def test_adapter_save_load_round_trip_and_refusals(digits_setup, tmp_path):
    root, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    randomize_adapters(apply_bundle(model, bundle), seed=7)
    x = _x()
    out = model(x).detach()
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    fresh = load_digits(ckpt)
    load_adapter(fresh, path)  # applies the recorded bundle, then loads A
    assert torch.equal(fresh(x), out)
    fresh2 = load_digits(ckpt)
    apply_bundle(fresh2, bundle)
    load_adapter(fresh2, path)
    assert torch.equal(fresh2(x), out)
    # another bundle for the same weights (different r): B/Q differ -> refused
    other_bundle = digits_bundle(ckpt, tmp_path / "bundle_r8", r=8, tau=0.8)
    m3 = load_digits(ckpt)
    apply_bundle(m3, other_bundle)
    with pytest.raises(BundleError, match="another bundle"):
        load_adapter(m3, path)
    # the same adapter onto other weights -> refused by the fingerprint check
    _, other_ckpt = digits_checkpoint(tmp_path / "w2", seed=2)
    with pytest.raises(BundleError, match="fingerprint"):
        load_adapter(load_digits(other_ckpt), path)


def test_adapter_whose_bundle_moved_or_other_model_says_what_to_do(digits_setup, tmp_path):
    """A moved bundle names bundle=; bundle=NEW reproduces the dense oracle; another model's bundle says rescan."""
    import shutil

    root, ckpt, bundle = digits_setup
    own = tmp_path / "bundle"
    shutil.copytree(bundle.path, own)
    model = load_digits(ckpt)
    params = apply_bundle(model, own, rho=0.5)
    randomize_adapters(params, seed=11)
    a_s = {name: layer.plate_A.detach().clone() for name, layer in plate_layers(model).items()}
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    shutil.move(own, tmp_path / "moved")
    with pytest.raises(BundleError, match=r"bundle, is not there \(moved or deleted\?\); pass its new place.*bundle="):
        load_adapter(load_digits(ckpt), path)
    fresh = load_digits(ckpt)
    load_adapter(fresh, path, bundle=tmp_path / "moved")
    base = load_digits(ckpt)
    w = dense_plate_weight(base.fc2.weight.detach(), bundle.b_idx("fc2"), a_s["fc2"], bundle.q("fc2"), 0.5)
    x = _x(d=256, seed=4)
    torch.testing.assert_close(fresh.fc2(x).double(), x.double() @ w.T + base.fc2.bias.double(), rtol=1e-5, atol=1e-5)
    renamed = nn.Sequential(nn.Linear(64, 256))  # no module named fc1..fc3
    with pytest.raises(BundleError, match=r"'fc1' \(and 2 more\): no module of the model \(Sequential\).*scan"):
        apply_bundle(renamed, bundle)


def test_bundle_names_map_onto_a_model_that_wraps_the_checkpoint(gpt2_ckpt):
    """GPT-2 checkpoints store h.0.attn.c_attn; GPT2LMHeadModel calls it transformer.h.0.attn.c_attn."""
    from helpers_train import skeleton

    from plate_inspect import scan

    bundle = scan(gpt2_ckpt.path, gpt2_ckpt.path.parent / "bundle", r=8, tau=0.8, max_rank=32, overwrite=True)
    outer = nn.Module()
    outer.transformer = skeleton(gpt2_ckpt.path, bundle.modules, layout="conv1d")
    params = apply_bundle(outer, bundle)  # fingerprints of the [d_in, d_out] Conv1D weights match the manifest
    assert set(plate_layers(outer)) == {f"transformer.{m}" for m in bundle.modules}
    assert all(layer.layout == "conv1d" for layer in plate_layers(outer).values())
    assert sum(p.numel() for p in params) == sum(rec.r * rec.k for rec in bundle)


def test_modules_by_name_suffix_as_in_peft(gpt2_ckpt):
    """modules=["c_attn"] wraps every bundle module ending in .c_attn (peft's list rule); the wrapped Conv1D's output
    is the dense oracle x (W + rho E_B A Q^T)^T + b; an unknown suffix is one BundleError line."""
    from helpers_train import skeleton

    from plate_inspect import scan

    bundle = scan(gpt2_ckpt.path, gpt2_ckpt.path.parent / "bundle_sfx", r=8, tau=0.8, max_rank=32, overwrite=True)
    outer = nn.Module()
    outer.transformer = skeleton(gpt2_ckpt.path, bundle.modules, layout="conv1d")
    randomize_adapters(apply_bundle(outer, bundle, rho=0.25, modules=["c_attn", "h.1.mlp.c_fc"]), seed=5)
    expected = {m for m in bundle.modules if m.endswith(".c_attn")} | {"h.1.mlp.c_fc"}
    assert len(expected) == 3 and set(plate_layers(outer)) == {f"transformer.{m}" for m in expected}
    layer = plate_layers(outer)["transformer.h.0.attn.c_attn"]
    w = dense_plate_weight(
        layer.base.weight.detach().T,
        bundle.b_idx("h.0.attn.c_attn"),
        layer.plate_A.detach(),
        bundle.q("h.0.attn.c_attn"),
        0.25,
    )
    x = _x(n=5, d=w.shape[1], seed=3)
    torch.testing.assert_close(layer(x).double(), x.double() @ w.T + layer.base.bias.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(BundleError, match=r"no module 'q_proj' in this bundle.*name suffixes"):
        apply_bundle(skeleton(gpt2_ckpt.path, bundle.modules, layout="conv1d"), bundle, modules="q_proj")


def _dense_model(ckpt, terms: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]):
    """The digits model with W + rho E_B A Q^T written into the named modules (float64 oracle, rounded once)."""
    model = load_digits(ckpt)
    with torch.no_grad():
        for m, (b_idx, a, q, rho) in terms.items():
            layer = getattr(model, m)
            layer.weight.copy_(dense_plate_weight(layer.weight.detach(), b_idx, a, q, rho).float())
    return model


def _edited_copy(bundle: Bundle, where, module: str) -> Bundle:
    """A copy of the bundle with one module's Q columns reversed (same shapes, names and fingerprints)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(bundle.path, where)
    part = where / bundle.record(module).file
    with safe_open(str(part), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(part))
    tensors[f"{module}.plate_Q"] = tensors[f"{module}.plate_Q"].flip(1).contiguous()
    save_file(tensors, str(part), metadata=meta)
    return Bundle.load(where)


def test_q_dtype_adapter_reloads_and_merges_and_an_edited_q_is_refused(digits_setup, tmp_path):
    """apply_bundle(q_dtype=bf16): B/Q's identity is the bundle's (not the rounded Q's), so the adapter reloads (with
    Q in bf16 again) and merges with the Q it held (bf16); a bundle whose Q was edited is still refused."""
    from oracles import load_all

    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    randomize_adapters(apply_bundle(model, bundle, q_dtype=torch.bfloat16), seed=3, scale=0.2)
    assert model.fc1.plate_Q.dtype == torch.bfloat16
    x = _x()
    out = model(x).detach()
    a = {m: getattr(model, m).plate_A.detach().clone() for m in BACKBONE}
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    fresh = load_digits(ckpt)
    load_adapter(fresh, path)
    assert fresh.fc1.plate_Q.dtype == torch.bfloat16  # the recorded q_dtype is applied again
    assert torch.equal(fresh(x), out)
    merge_checkpoint(ckpt, path, tmp_path / "merged")
    merged, base = load_all(tmp_path / "merged"), load_digits(ckpt)
    for m in BACKBONE:
        held_q = bundle.q(m).to(torch.bfloat16)  # the Q the layers computed with
        expect = dense_plate_weight(getattr(base, m).weight.detach(), bundle.b_idx(m), a[m], held_q, 0.5)
        torch.testing.assert_close(merged[f"{m}.weight"].double(), expect, rtol=0, atol=1e-6)
    edited = _edited_copy(bundle, tmp_path / "edited", "fc2")
    target = load_digits(ckpt)
    with pytest.raises(BundleError, match="'fc2' was trained with another bundle"):
        load_adapter(target, path, bundle=edited)
    assert not plate_layers(target) and all(p.requires_grad for p in target.parameters())  # left as it was
    with pytest.raises(BundleError, match="'fc2' was trained with another bundle"):
        merge_checkpoint(ckpt, path, tmp_path / "merged2", bundle=edited)


def test_apply_bundle_twice_keeps_every_a_trainable_and_rho_per_module(digits_setup, tmp_path):
    from oracles import load_all
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    first = apply_bundle(model, bundle, rho=0.5, modules=["fc1"])
    second = apply_bundle(model, bundle, rho=2.0, modules=["fc2", "fc3"])
    assert all(p.requires_grad for p in first + second)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {f"{m}.plate_A" for m in BACKBONE}
    randomize_adapters(first + second, seed=4, scale=0.2)
    rhos = {"fc1": 0.5, "fc2": 2.0, "fc3": 2.0}
    terms = {m: (bundle.b_idx(m), getattr(model, m).plate_A.detach(), bundle.q(m), rhos[m]) for m in BACKBONE}
    x = _x()
    out = model(x).detach()
    torch.testing.assert_close(out, _dense_model(ckpt, terms)(x), rtol=1e-5, atol=1e-5)
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    fresh = load_digits(ckpt)
    load_adapter(fresh, path)
    assert {m: getattr(fresh, m).rho for m in BACKBONE} == rhos
    assert torch.equal(fresh(x), out)
    merge_checkpoint(ckpt, path, tmp_path / "merged")
    merged = load_all(tmp_path / "merged")
    dense = _dense_model(ckpt, terms)
    for m in BACKBONE:
        torch.testing.assert_close(merged[f"{m}.weight"], getattr(dense, m).weight, rtol=1e-6, atol=1e-6)
    # an adapter written before per-module rho and q_dtypes (one "rho" for all modules) still loads
    one = load_digits(ckpt)
    randomize_adapters(apply_bundle(one, bundle, rho=0.75), seed=5, scale=0.2)
    old = save_adapter(one, tmp_path / "old.safetensors")
    with safe_open(str(old), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del meta["q_dtypes"]
    assert meta["rho"] == "0.75"
    save_file(tensors, str(old), metadata=meta)
    again = load_digits(ckpt)
    load_adapter(again, old)
    assert {getattr(again, m).rho for m in BACKBONE} == {0.75}
    assert torch.equal(again(x), one(x))


def test_load_adapter_with_another_bundle_is_refused_before_any_plan_error(digits_setup, tmp_path):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    randomize_adapters(apply_bundle(model, bundle), seed=6, scale=0.2)
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    smaller_k = digits_bundle(ckpt, tmp_path / "tau95", r=16, tau=0.95)  # same weights, fewer directions
    assert any(smaller_k.record(m).k < bundle.record(m).k for m in BACKBONE)
    target = load_digits(ckpt)
    with pytest.raises(BundleError, match=r"made with bundle .*another one \(module '.*': A is .*k <= "):
        load_adapter(target, path, bundle=smaller_k)
    assert not plate_layers(target)
    _, other_ckpt = digits_checkpoint(tmp_path / "w", seed=4)
    other = digits_bundle(other_ckpt, tmp_path / "other")
    with pytest.raises(BundleError, match="another one \\(made for other weights: module 'fc1'"):
        load_adapter(load_digits(ckpt), path, bundle=other)


@pytest.mark.parametrize("rho", [float("nan"), float("inf"), 0.0, -1.0, "0.5", None, True])
def test_rho_must_be_a_positive_finite_number(digits_setup, rho):
    _, ckpt, bundle = digits_setup
    with pytest.raises(ConfigError, match="rho must be a positive finite number"):
        PlateLinear(nn.Linear(4, 3), torch.tensor([0]), torch.zeros(4, 2), rho=rho)
    model = load_digits(ckpt)
    with pytest.raises(ConfigError, match="rho must be a positive finite number"):
        apply_bundle(model, bundle, rho=rho)
    assert not plate_layers(model)


def test_modules_takes_one_name_or_a_list(digits_setup):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    apply_bundle(model, bundle, modules="fc2")
    assert set(plate_layers(model)) == {"fc2"}
    with pytest.raises(ConfigError, match="modules must be a list"):
        apply_bundle(load_digits(ckpt), bundle, modules=3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m cuda on a GPU machine)")
def test_cuda_forward_merge_match_cpu(digits_setup):
    _, ckpt, bundle = digits_setup
    outs = {}
    for dev in ("cpu", "cuda"):
        model = load_digits(ckpt).to(dev)
        randomize_adapters(apply_bundle(model, bundle), seed=8, scale=0.1)
        x = _x().to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            auto = model(x).float()
        out = model(x)
        merge_all(model)
        torch.testing.assert_close(model(x), out, rtol=1e-4, atol=1e-4)
        outs[dev] = (out.cpu(), auto.cpu())
    torch.testing.assert_close(outs["cuda"][0], outs["cpu"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["cuda"][1], outs["cpu"][1], rtol=0.05, atol=0.05)
