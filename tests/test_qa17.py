"""Session-17 QA tour of the README as a first-time user: what a user met that the README did not lead them to expect.

Oracles: the checkpoint's own tensor names (a Qwen2 LoRA's modules are not GPT-2's), the DeepSeek-V3 config's
``num_nextn_predict_layers`` (the multi-token-prediction layer the default scan leaves out) and the CLI's own option
names (``--include-mtp``), and the modules a scan with that option writes.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import load_all
from safetensors.torch import save_file

from plate_inspect.cli.main import cli
from plate_inspect.testing.synthetic import write_family, write_gpt2, write_llama_like


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


def test_mtp_note_names_the_cli_option_that_scans_it(tmp_path):
    """QA: `plate-inspect scan` of a DeepSeek-V3 checkpoint printed "multi-token-prediction layer 2 skipped
    (include_mtp to scan it)": the Python keyword, which the CLI does not take. The note now names `--include-mtp`
    (and the keyword), and that option does scan the layer the note names."""
    ckpt = write_family(tmp_path / "dsv3", "deepseek_v3", layers=2)
    mtp = ckpt.config["num_hidden_layers"]  # the MTP layer's index: num_hidden_layers (one of them here)
    assert ckpt.config["num_nextn_predict_layers"] == 1
    runner = CliRunner()
    skipped = runner.invoke(cli, ["scan", str(ckpt.path), "--out", str(tmp_path / "b"), "--r", "4", "-q"])
    assert skipped.exit_code == 0, skipped.output
    assert f"multi-token-prediction layer {mtp} skipped (scan it with --include-mtp" in skipped.output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert all(rec["layer"] != mtp for rec in manifest["modules"].values())
    option = "--include-mtp"
    assert option in runner.invoke(cli, ["scan", "--help"]).output
    with_mtp = runner.invoke(cli, ["scan", str(ckpt.path), "--out", str(tmp_path / "m"), "--r", "4", option, "-q"])
    assert with_mtp.exit_code == 0, with_mtp.output
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert any(rec["layer"] == mtp for rec in manifest["modules"].values())


def test_read_weight_of_a_module_name_names_its_weight(tmp_path):
    """QA: the README's API reads weights by name (`read_weight('model.layers.0.self_attn.q_proj.weight')`), while
    bundles name modules without `.weight`; `ckpt.read_weight(bundle.modules[0])` said only "has no weight named
    ...". It now names the weight to read, and reading that one gives the stored tensor (safetensors' own loader)."""
    from safetensors.torch import load_file

    from plate_inspect.checkpoint import Checkpoint
    from plate_inspect.errors import CheckpointError

    ckpt_dir = write_llama_like(tmp_path / "m", layers=1, dtype=torch.float32).path
    module = "model.layers.0.self_attn.q_proj"
    ckpt = Checkpoint.open(ckpt_dir)
    with pytest.raises(CheckpointError) as err:
        ckpt.read_weight(module)
    assert f"read its weight '{module}.weight'" in str(err.value) and "\n" not in str(err.value), str(err.value)
    weight, _ = ckpt.read_weight(f"{module}.weight")
    assert torch.equal(weight, load_file(str(ckpt_dir / "model.safetensors"))[f"{module}.weight"])
    with pytest.raises(CheckpointError, match=r"no weight named 'model\.layers\.0\.nothing'; .*logical_weights"):
        ckpt.read_weight("model.layers.0.nothing")


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


def test_verify_exact_says_why_a_share_above_one_is_ok(tmp_path):
    """QA: `verify --exact` of a bundle scanned with --q-dtype bfloat16 printed "largest share of the allowance
    used: 2.2" and then "ok", with no reason. The check allows for Q's storage rounding (a bf16 Q's energy can
    exceed an optimum of ~0 by its rounding alone): the line now says so; a float32 bundle's line does not."""
    ckpt = write_llama_like(tmp_path / "ckpt", layers=1).path
    runner = CliRunner()
    for q_dtype in ("bfloat16", "float32"):
        out = tmp_path / q_dtype
        assert runner.invoke(cli, ["scan", str(ckpt), "--out", str(out), "--q-dtype", q_dtype, "-q"]).exit_code == 0
        result = runner.invoke(cli, ["verify", str(out), str(ckpt), "--exact", "--json"])
        assert result.exit_code == 0, result.output
        worst = max(m["used"] for m in json.loads(result.stdout)["exactness"].values())
        text = runner.invoke(cli, ["verify", str(out), str(ckpt), "--exact"])
        assert text.exit_code == 0 and "ok: 7 modules verified" in text.output, text.output
        said = "(over 1, but within the rounding of Q's stored dtype" in " ".join(text.output.split())
        assert (worst > 1, said) == ((True, True) if q_dtype == "bfloat16" else (False, False)), (worst, text.output)
