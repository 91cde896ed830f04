"""Adapters given where a model or a bundle is expected: a PLATE adapter file to scan, verify and info (the base
model it records is named, with the command to run), and a LoRA of another architecture to audit."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from oracles import load_all
from safetensors.torch import save_file

from plate_inspect.cli.main import cli
from plate_inspect.testing.synthetic import write_gpt2, write_llama_like


def _lora_dir(path, base_tensors, module: str, config: dict) -> None:
    """A PEFT-layout LoRA adapter dir by hand (adapter_config.json + adapter_model.safetensors) on one module."""
    d_out, d_in = base_tensors[f"{module}.weight"].shape
    g = torch.Generator().manual_seed(0)
    path.mkdir(parents=True)
    save_file(
        {
            f"base_model.model.{module}.lora_A.weight": torch.randn(2, d_in, generator=g),
            f"base_model.model.{module}.lora_B.weight": torch.randn(d_out, 2, generator=g),
        },
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))


def test_lora_of_another_architecture_says_which_base_to_pass(tmp_path):
    """QA: `plate-inspect audit ./gpt2 ./qwen2-lora` said only "module 'model.layers.0.self_attn.q_proj' matches
    no module of the base checkpoint": nothing said that the adapter belongs to another model or what to do. Now
    the one line names the adapter, a module, BASE's model_type, the model adapter_config.json names, and the fix
    (the shape-mismatch case of the same mistake already did)."""
    qwen = write_llama_like(tmp_path / "qwen", layers=1, dtype=torch.float32)
    gpt2 = write_gpt2(tmp_path / "gpt2", layers=1)
    module = "model.layers.0.self_attn.q_proj"
    assert not any(module in name for name in load_all(gpt2.path))  # the oracle: GPT-2 has no such module
    _lora_dir(tmp_path / "lora", load_all(qwen.path), module, {"base_model_name_or_path": "org/qwen-tiny"})
    result = CliRunner().invoke(cli, ["audit", str(gpt2.path), str(tmp_path / "lora"), "-q"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.output
    assert module in line and "model_type gpt2" in line, line
    assert "trained on another model (org/qwen-tiny, says adapter_config.json)" in line, line
    assert line.endswith("pass the model it was trained on as BASE"), line
    # the same adapter against its own base is audited: the check does not refuse a LoRA that fits
    ok = CliRunner().invoke(cli, ["audit", str(qwen.path), str(tmp_path / "lora"), "--json", "-q"])
    assert ok.exit_code == 0, ok.output
    assert [r["module"] for r in json.loads(ok.stdout)] == [module]


def test_scanning_a_plate_adapter_file_says_it_is_an_adapter(tmp_path):
    """QA: `plate-inspect scan adapter.safetensors` (a save_adapter file, the README's training output) ended in
    "no target modules matched (...); weights in this checkpoint have types: none". PEFT and LoRA adapters were
    already refused as adapters; a PLATE adapter file (or a directory holding one) now is too, in one line naming
    the file, its base model (the source its bundle records) and the merge command."""
    from helpers_train import digits_bundle, digits_checkpoint

    from plate_inspect.train.layer import apply_bundle, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=8, tau=0.9)
    apply_bundle(model, bundle, rho=0.5)
    adapter = save_adapter(model, tmp_path / "ad" / "adapter.safetensors")
    base_id = json.loads((tmp_path / "bundle" / "manifest.json").read_text())["source"]["id"]
    for given in (adapter, adapter.parent):
        result = CliRunner().invoke(cli, ["scan", str(given), "--out", str(tmp_path / "b"), "-q"])
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {adapter}: a PLATE adapter (save_adapter: 'fc1.plate_A'), not a model"), line
        assert f"scan its base model ({base_id}, as the adapter records it)" in line, line
        assert "plate-inspect merge BASE ADAPTER --out OUT" in line, line
    assert not (tmp_path / "b").exists()
    # the model it names is scanned as a model
    ok = CliRunner().invoke(cli, ["scan", base_id, "--out", str(tmp_path / "b"), "--r", "8", "-q"])
    assert ok.exit_code == 0, ok.output


def _plate_adapter(tmp_path):
    """A digits MLP checkpoint, its bundle, and a save_adapter file trained from it (the README's training output)."""
    from helpers_train import digits_bundle, digits_checkpoint

    from plate_inspect.train.layer import apply_bundle, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "ckpt")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=8, tau=0.9)
    apply_bundle(model, bundle, rho=0.5)
    adapter = save_adapter(model, tmp_path / "ad" / "adapter.safetensors")
    return ckpt, tmp_path / "bundle", adapter


def test_verify_against_an_adapter_says_model_is_an_adapter(tmp_path):
    """QA: `verify BUNDLE adapter.safetensors` listed one "no weight" problem per module and said the bundle was
    made for another model. MODEL is an adapter: one line now says so (scan's refusal, worded for verify), naming
    the base model the adapter records; verifying against that base still passes."""
    ckpt, bundle, adapter = _plate_adapter(tmp_path)
    base_id = json.loads((bundle / "manifest.json").read_text())["source"]["id"]
    result = CliRunner().invoke(cli, ["verify", str(bundle), str(adapter)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {adapter}: a PLATE adapter (save_adapter: 'fc1.plate_A'), not a model"), line
    assert f"verify the bundle against its base model ({base_id}, as the adapter records it)" in line, line
    assert "no weight" not in result.output
    ok = CliRunner().invoke(cli, ["verify", str(bundle), str(ckpt)])
    assert ok.exit_code == 0 and "ok:" in ok.output, ok.output


def test_moved_bundle_of_an_adapter_is_named_with_how_to_point_at_it(tmp_path):
    """QA: with the adapter's bundle moved, `info adapter.safetensors` suggested `plate-inspect info <old path>`
    (not there) and `audit BASE adapter.safetensors` said "the adapter's bundle is not found" without the path it
    looked at. Both now name the recorded path, say it is not there, and say how to give the new place; audit with
    --bundle NEW then runs (and the Python API names the keyword with its flag)."""
    import pytest

    from plate_inspect.auditing import audit
    from plate_inspect.errors import BundleError

    ckpt, bundle, adapter = _plate_adapter(tmp_path)
    moved = bundle.rename(tmp_path / "moved-bundle")
    runner = CliRunner()
    info = runner.invoke(cli, ["info", str(adapter)])
    assert info.exit_code == 2, info.output
    (line,) = info.stderr.strip().splitlines()
    assert f"trained with the bundle {bundle}, which is not there" in line, line
    assert f"plate-inspect info {bundle}" not in line and "--bundle" in line, line
    result = runner.invoke(cli, ["audit", str(ckpt), str(adapter), "-q"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert f"the bundle this adapter was made with, {bundle}, is not there" in line, line
    assert line.endswith("pass its new place as --bundle"), line
    with pytest.raises(BundleError, match=r"pass its new place as bundle=DIR \(CLI: --bundle\)"):
        audit(ckpt, adapter)
    ok = runner.invoke(cli, ["audit", str(ckpt), str(adapter), "--bundle", str(moved), "-q"])
    assert ok.exit_code == 0, ok.output
    # the bundle in place: info still points at it
    moved.rename(bundle)
    there = runner.invoke(cli, ["info", str(adapter)])
    assert f"plate-inspect info {bundle}" in there.stderr, there.output
