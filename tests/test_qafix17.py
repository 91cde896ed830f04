"""Session-17 QA rough edges, fixed: each test is what a user met, and what they see now.

Oracles: the paths the test itself writes and moves (an adapter, its bundle), the module names a scan writes to its
manifest, the CLI's own command names, and the checkpoint's own tensor count.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from plate_inspect.cli.main import cli


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


def test_rescan_line_names_damaged_and_missing_part_files(tmp_path):
    """QA: a rescan that met one damaged module and a deleted part file said "1 module damaged in the part files
    (digest mismatch): recomputed 8, kept 6 of 14": the 7 modules of the missing file were not named. The line now
    names both, with counts taken from the bundle's own manifest (the deleted file's modules)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import plate_inspect
    from plate_inspect.cli.scan import reuse_line
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "ckpt", layers=2).path
    out = tmp_path / "b"
    fresh = plate_inspect.scan(ckpt, out, r=4)
    records = list(fresh)
    files = sorted({rec.file for rec in records})
    assert len(files) >= 2, files
    lost = [rec.name for rec in records if rec.file == files[1]]
    (out / files[1]).unlink()
    name = next(rec.name for rec in records if rec.file == files[0])
    with safe_open(str(out / files[0]), "pt") as f:
        meta = f.metadata()
    tensors = load_file(out / files[0])
    tensors[f"{name}.redundancy"][0] *= -1
    save_file(tensors, out / files[0], metadata=meta)
    stats = plate_inspect.scan(ckpt, out, r=4).stats()
    total = len(records)
    assert (stats["modules_damaged"], stats["modules_scanned"]) == (1, 1 + len(lost)), stats
    assert reuse_line(stats) == (
        f"1 module damaged in the part files (digest mismatch), {len(lost)} whose part files were missing or "
        f"unreadable: recomputed {1 + len(lost)}, kept {total - 1 - len(lost)} of {total}"
    )
    ref = plate_inspect.scan(ckpt, tmp_path / "ref", r=4)  # an independent scan: the repaired modules equal it
    repaired = plate_inspect.Bundle.load(out)
    for module in [name, *lost]:
        assert torch.equal(repaired.q(module), ref.q(module)), module


def test_no_gpu_errors_name_the_keyword_in_python_and_the_flag_in_the_cli(tmp_path, monkeypatch):
    """QA: `plate_inspect.scan(..., devices="all")` on a machine without a GPU raised "--devices all: ... use --device
    cpu": CLI flags in a Python call. The message now names the keyword with its flag (the errors module's
    "keyword (CLI: --flag)" form); the CLI still prints just the flags. (No GPU is simulated: torch reports none.)"""
    import pytest
    import torch

    import plate_inspect
    from plate_inspect.errors import ConfigError
    from plate_inspect.testing.synthetic import write_llama_like

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ckpt = write_llama_like(tmp_path / "ckpt", layers=1).path
    with pytest.raises(ConfigError) as err:
        plate_inspect.scan(ckpt, tmp_path / "a", devices="all")
    assert str(err.value) == (
        'devices="all" (CLI: --devices all): no CUDA device is visible; use device="cpu" (CLI: --device cpu)'
    )
    with pytest.raises(ConfigError, match=r'^device="cuda" \(CLI: --device cuda\) was requested.*device="cpu"'):
        plate_inspect.scan(ckpt, tmp_path / "b", device="cuda")
    runner = CliRunner()
    for flags, said in (
        (["--devices", "all"], "error: --devices all: no CUDA device is visible; use --device cpu"),
        (["--device", "cuda"], "error: --device cuda was requested but no CUDA device is available; use --device cpu"),
    ):
        result = runner.invoke(cli, ["scan", str(ckpt), "--out", str(tmp_path / "c"), "-q", *flags])
        assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1] == said, result.output
    assert not any((tmp_path / d).exists() for d in "abc")


def test_scan_plan_and_checkpoint_reprs_are_one_short_line(tmp_path):
    """QA: a ScanPlan's repr (in a REPL) printed every tensor of the checkpoint. ScanPlan and Checkpoint now show
    one line: the source, the tensor count (counted here with safetensors' own loader), the target count and the
    settings, and no tensor name."""
    from conftest import load_all

    from plate_inspect.scanner import ScanSettings, plan_scan
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "ckpt", layers=4).path
    names = list(load_all(ckpt))
    plan = plan_scan(ckpt, ScanSettings(r=8))
    text = repr(plan)
    assert "\n" not in text and len(text) < 400, text
    assert not any(name in text for name in names), text
    assert text.startswith(f"ScanPlan(Checkpoint({str(ckpt)!r}, files=1, tensors={len(names)}, model_type='qwen2')")
    assert f"targets={7 * 4}, ScanSettings(r=8, " in text, text


def test_misspelt_command_gets_a_did_you_mean():
    """QA: `plate-inspect scna` said only "No such command 'scna'": the top-level group loads its commands lazily,
    so click had none to suggest from. The one error line now names the closest command (taken from the CLI's own
    command list); a word close to none gets no suggestion, and a right command still runs."""
    from plate_inspect.cli.main import COMMANDS

    runner = CliRunner()
    for typo, meant in (("scna", "scan"), ("verfy", "verify"), ("audti", "audit")):
        assert meant in COMMANDS
        result = runner.invoke(cli, [typo], prog_name="plate-inspect")
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == (
            f"error: No such command '{typo}'. Did you mean '{meant}'? (see plate-inspect --help)"
        ), result.stderr
    far = runner.invoke(cli, ["xyzzy"], prog_name="plate-inspect")
    assert far.exit_code == 2 and far.stderr.strip() == "error: No such command 'xyzzy'. (see plate-inspect --help)"
    assert runner.invoke(cli, ["scan", "--help"]).exit_code == 0
