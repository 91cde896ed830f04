"""Sequential PLATE: merge-and-write keeps the checkpoint's layout, rescans via the scanner, two merges in a row."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers_train import (
    BACKBONE,
    dense_plate_weight,
    digits_bundle,
    digits_checkpoint,
    fp8_setup,
    load_digits,
    model_holding,
    randomize_adapters,
    skeleton,
)
from oracles import load_all
from safetensors import safe_open

from plate_inspect import scan
from plate_inspect.bundle import Bundle
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError, CheckpointError
from plate_inspect.experiments import digits
from plate_inspect.train.layer import apply_bundle, save_adapter
from plate_inspect.train.sequential import merge_checkpoint, sequential_step


def _train_adapter(model, bundle, task, task_id, seed):
    params = apply_bundle(model, bundle)
    head = model.head1 if task_id == 1 else model.head2
    for p in head.parameters():
        p.requires_grad_(True)
    digits.train(model, params + list(head.parameters()), task, task_id, epochs=2, seed=seed)
    return params


@pytest.fixture
def one_thread():
    """Single-threaded torch for bit-reproducible training, restored afterwards (no leak into other tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_two_sequential_merges_on_digits(tmp_path, one_thread):
    _, ckpt0 = digits_checkpoint(tmp_path / "t0", seed=0)
    bundle0 = digits_bundle(ckpt0, tmp_path / "b0", r=16, tau=0.8)
    t1, t2 = digits.load_digit_tasks()
    w = {m: load_digits(ckpt0).get_submodule(m).weight.detach().double() for m in BACKBONE}
    x = t1.x_test[:20]
    bundle = bundle0
    ckpt = ckpt0
    for step, (task, tid) in enumerate(((t1, 1), (t2, 2)), start=1):
        model = load_digits(ckpt)
        params = _train_adapter(model, bundle, task, tid, seed=step)
        model.eval()
        backbone_out = model.features(x).detach()
        for m, a in zip(BACKBONE, params, strict=True):  # oracle: accumulate the dense updates in float64
            w[m] = dense_plate_weight(w[m], bundle.b_idx(m), a.detach(), bundle.q(m), 0.5)
        adapter = save_adapter(model, tmp_path / f"adapter{step}.safetensors")
        res = sequential_step(ckpt, adapter, tmp_path / f"t{step}", bundle_out=tmp_path / f"b{step}")
        assert res.merged_modules == BACKBONE
        assert [f.name for f in res.files] == ["model.safetensors"]
        merged = load_digits(res.files[0])
        torch.testing.assert_close(merged.features(x), backbone_out, rtol=1e-5, atol=1e-5)
        for m in BACKBONE:
            torch.testing.assert_close(merged.get_submodule(m).weight.double(), w[m], rtol=0, atol=1e-5)
        # the rescan is the scanner's: identical to scanning the merged file directly
        direct = scan(res.files[0], tmp_path / f"direct{step}", r=16, tau=0.8, max_rank=256, target_modules=BACKBONE)
        for m in BACKBONE:
            assert torch.equal(res.bundle.b_idx(m), direct.b_idx(m))
            assert torch.equal(res.bundle.q(m), direct.q(m))
            assert res.bundle.record(m).fingerprint == direct.record(m).fingerprint
        assert res.bundle.settings == bundle0.settings
        apply_bundle(load_digits(res.files[0]), res.bundle)  # the new bundle matches the merged weights
        bundle, ckpt = res.bundle, res.files[0]
    # everything outside the adapted weights is byte-identical to the first checkpoint
    first, last = load_all(tmp_path / "t0"), load_all(tmp_path / "t2")
    for name in first:
        if name.removesuffix(".weight") not in BACKBONE:
            assert torch.equal(first[name], last[name]), name


def test_merge_keeps_sharded_bf16_layout(qwen_ckpt, tmp_path):
    src = qwen_ckpt.path
    bundle = scan(src, tmp_path / "bundle", r=8, tau=0.8, max_rank=32, layers=[0])
    model = skeleton(src, bundle.modules)
    params = apply_bundle(model, bundle)
    randomize_adapters(params, seed=0, scale=0.05)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    out = tmp_path / "merged"
    events = []
    result = merge_checkpoint(src, adapter, out, progress=events.append)
    # one progress event per tensor written, bytes adding up to the stored sizes (counted by safetensors' loader)
    stored = load_all(src)
    assert [e.done for e in events] == list(range(len(stored) + 1))
    assert sorted(e.label for e in events[1:]) == sorted(stored)
    assert events[-1].bytes_done == events[-1].bytes_total == sum(t.numel() * t.element_size() for t in stored.values())
    assert sorted(p.name for p in result.files) == sorted(p.name for p in src.glob("*.safetensors"))
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (out / "model.safetensors.index.json").read_text() == (src / "model.safetensors.index.json").read_text()
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as a, safe_open(str(out / f.name), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
    before, after = load_all(src), load_all(out)
    layers = {m: model.get_submodule(m) for m in bundle.modules}
    for name, t in before.items():
        assert after[name].dtype == t.dtype and after[name].shape == t.shape
        module = name.removesuffix(".weight")
        if module in layers and name.endswith(".weight"):
            layer = layers[module]
            expect = dense_plate_weight(t, layer.plate_B_idx, layer.plate_A.detach(), layer.plate_Q, 0.5)
            torch.testing.assert_close(after[name].double(), expect.to(torch.bfloat16).double(), rtol=0, atol=0)
        else:
            assert torch.equal(after[name], t), name
    with pytest.raises(CheckpointError, match="already holds"):
        merge_checkpoint(src, adapter, out)


def test_merge_conv1d_layout(gpt2_ckpt, tmp_path):
    src = gpt2_ckpt.path
    bundle = scan(src, tmp_path / "bundle", r=8, tau=0.8, max_rank=32)
    model = skeleton(src, bundle.modules, layout="conv1d")
    randomize_adapters(apply_bundle(model, bundle), seed=1, scale=0.1)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    merge_checkpoint(src, adapter, tmp_path / "merged")
    before, after = load_all(src), load_all(tmp_path / "merged")
    for m in bundle.modules:
        layer = model.get_submodule(m)
        a, b_idx = layer.plate_A.detach(), layer.plate_B_idx
        expect = dense_plate_weight(before[f"{m}.weight"].T, b_idx, a, layer.plate_Q, 0.5).T  # stored [d_in, d_out]
        assert after[f"{m}.weight"].shape == before[f"{m}.weight"].shape
        torch.testing.assert_close(after[f"{m}.weight"].double(), expect, rtol=0, atol=1e-6)  # float32 rounding
        frozen = torch.ones(expect.shape[1], dtype=torch.bool)
        frozen[b_idx] = False
        assert torch.equal(after[f"{m}.weight"][:, frozen], before[f"{m}.weight"][:, frozen])


def test_merge_refuses_other_weights_and_cli(tmp_path):
    _, ckpt = digits_checkpoint(tmp_path / "a", seed=0)
    _, other = digits_checkpoint(tmp_path / "b", seed=1)
    bundle = digits_bundle(ckpt, tmp_path / "bundle")
    model = load_digits(ckpt)
    randomize_adapters(apply_bundle(model, bundle), seed=2, scale=0.1)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    with pytest.raises(BundleError, match="other weights"):
        merge_checkpoint(other, adapter, tmp_path / "bad")
    result = CliRunner().invoke(
        cli, ["merge", str(ckpt), str(adapter), "--out", str(tmp_path / "m"), "--rescan", str(tmp_path / "b2")]
    )
    assert result.exit_code == 0, result.output
    assert "merged 3 modules" in result.output
    assert len(Bundle.load(tmp_path / "b2")) == 3
    bad = CliRunner().invoke(cli, ["merge", str(other), str(adapter), "--out", str(tmp_path / "bad2")])
    assert bad.exit_code == 2 and "other weights" in bad.output and "Traceback" not in bad.output


def test_failed_merge_leaves_no_partial_output(tmp_path):
    """A check that fails after some shards were written: nothing appears in --out, no temp dir is left behind."""
    from safetensors.torch import load_file, save_file

    from plate_inspect.testing.synthetic import write_llama_like

    src = write_llama_like(tmp_path / "src", layers=2, max_shard_bytes=40_000).path
    bundle = scan(src, tmp_path / "bundle", r=8, tau=0.8, max_rank=32)
    model = skeleton(src, bundle.modules)
    randomize_adapters(apply_bundle(model, bundle), seed=3, scale=0.05)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    last = max(bundle.modules, key=lambda m: shards.index(index[f"{m}.weight"]))
    assert shards.index(index[f"{last}.weight"]) > 0  # earlier shards are written before the failing check
    shard = src / index[f"{last}.weight"]
    tensors = load_file(str(shard))
    tensors[f"{last}.weight"] = tensors[f"{last}.weight"].clone()
    tensors[f"{last}.weight"][0, 0] += 1  # the weights changed after the adapter was trained
    save_file(tensors, str(shard))
    with pytest.raises(BundleError, match=f"'{last}'.*other weights"):
        merge_checkpoint(src, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="other weights"):
        merge_checkpoint(src, adapter, existing)
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name) == []


def test_merge_into_quantized_or_stacked_expert_storage_is_refused_up_front(tmp_path):
    """Merging would need re-quantizing FP8 (or rewriting a 3-D expert stack): refused before anything is written,
    pointing to a merge in the model (QA: the error said FP8 is read and refused it in one line)."""
    from dataclasses import replace

    from plate_inspect.checkpoint import Checkpoint
    from plate_inspect.train.sequential import _stored_name

    bundle, dequantized, fp8_dir = fp8_setup(tmp_path)
    model = model_holding(dequantized)
    apply_bundle(model, bundle)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    with pytest.raises(CheckpointError, match="stored as F8_E4M3 .quantized.; merging would need re-quantizing"):
        merge_checkpoint(fp8_dir, adapter, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    result = CliRunner().invoke(cli, ["merge", str(fp8_dir), str(adapter), "-o", str(tmp_path / "merged")])
    assert result.exit_code == 2 and "merge_and_unload" in result.output and "Traceback" not in result.output
    record = bundle.record(next(iter(bundle.manifest.modules)))
    stacked = replace(record, name="model.layers.0.mlp.experts.down_proj.3", layout="experts_out_major", dtype="BF16")
    with pytest.raises(CheckpointError, match="one expert's slice of the 3-D tensor 'model.layers.0.mlp.experts"):
        _stored_name(Checkpoint.open(fp8_dir), stacked.name, stacked)
