"""audit BASE TUNED given the other way round: a bf16 BASE that is exactly the fp32 TUNED rounded to bf16 is a
lower-precision copy of TUNED, not the model TUNED was fine-tuned from; the audit says so (CLI, JSON, report).
The right way round, a bf16 save of an fp32 fine-tune scores its update, not the rounding."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from plate_inspect.auditing import AUDIT_KEYS, SWAPPED_KEYS, audit, swapped_note
from plate_inspect.cli.main import cli
from plate_inspect.reports.audit import audit_section
from plate_inspect.testing.synthetic import write_llama_like

R = "8"


def _copy(src, dst, transform) -> None:
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: transform(k, v) for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def _audit_json(base, tuned) -> list[dict]:
    res = CliRunner().invoke(cli, ["audit", str(base), str(tuned), "--r", R, "--json", "-q"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_a_bf16_copy_given_as_base_is_flagged(tmp_path):
    fp32 = tmp_path / "fp32"
    write_llama_like(fp32, layers=1, dtype=torch.float32, planted_fraction=0.15)
    _copy(fp32, tmp_path / "bf16", lambda k, v: v.to(torch.bfloat16))

    # swapped: BASE = the bf16 copy, TUNED = the fp32 original -> every module flagged, in JSON and in the CLI note
    records = _audit_json(tmp_path / "bf16", fp32)
    assert len(records) == 7
    for rec in records:
        assert list(rec) == list(AUDIT_KEYS + SWAPPED_KEYS), rec
        assert rec["tuned_rounds_to_base"] == "bfloat16" and rec["delta_norm"] > 0
    res = CliRunner().invoke(cli, ["audit", str(tmp_path / "bf16"), str(fp32), "--r", R, "-q"])
    assert res.exit_code == 0, res.output
    assert "in 7 of 7 modules BASE is exactly TUNED rounded to BASE's bfloat16" in res.output
    assert "were BASE and TUNED swapped?" in res.output
    api = audit(tmp_path / "bf16", fp32, r=int(R))
    assert "Note: in 7 of 7 modules" in audit_section(api, "swapped")

    # the right order: no such key (the bf16 TUNED's rounding is the other note)
    for rec in _audit_json(fp32, tmp_path / "bf16"):
        assert "tuned_rounds_to_base" not in rec and rec["base_rounded_to"] == "bfloat16"

    # a real fp32 fine-tune of a bf16 BASE: TUNED rounded to bf16 is not BASE where the update is larger than a
    # bf16 step -> not flagged there; modules left untouched by the fine-tune (equal to BASE after the upcast) score
    # no update and are not flagged either
    gen = torch.Generator().manual_seed(1)

    def fine_tune(k: str, v: torch.Tensor) -> torch.Tensor:
        w = v.to(torch.bfloat16).float()
        return w + 0.05 * w.abs().max() * torch.randn(w.shape, generator=gen) if "q_proj" in k else w

    _copy(fp32, tmp_path / "ft", fine_tune)
    ft_records = _audit_json(tmp_path / "bf16", tmp_path / "ft")
    assert {rec["module"].rsplit(".", 1)[-1] for rec in ft_records if rec["delta_norm"] > 0} == {"q_proj"}
    assert all("tuned_rounds_to_base" not in rec for rec in ft_records)
    assert swapped_note(audit(tmp_path / "bf16", tmp_path / "ft", r=int(R))) is None


def test_a_bf16_save_of_an_fp32_fine_tune_scores_its_update_not_the_rounding(tmp_path):
    """QA: TUNED stored in bf16 over an fp32 BASE: dW was TUNED - BASE, so every weight's storage rounding counted
    as an update. A bf16 copy of BASE itself audited as "3/3 modules changed", ||dW||/||W|| 1.5e-3, frozen-row
    share 0.94, protected share at chance; a PLATE fine-tune (merged by `plate-inspect merge`, then saved in bf16)
    showed a frozen-row share of up to 7e-4 where PLATE touches none, and 2.5x its risk. Now dW = TUNED - BASE
    rounded to bf16: the copy is unchanged, and the merged PLATE update keeps frozen-row share exactly 0 (oracle:
    the fp32 merge's own audit, where dW is exactly rho A Q^T on B's rows) and its ||dW|| to bf16 rounding."""
    import torch
    from click.testing import CliRunner
    from helpers_train import digits_bundle, digits_checkpoint, randomize_adapters
    from safetensors.torch import load_file, save_file

    from plate_inspect.auditing import audit
    from plate_inspect.cli.main import cli
    from plate_inspect.train.layer import apply_bundle, save_adapter

    model, ckpt = digits_checkpoint(tmp_path / "base")
    bundle = digits_bundle(ckpt, tmp_path / "bundle", r=16, tau=0.8)
    randomize_adapters(apply_bundle(model, bundle, rho=0.5), seed=1, scale=0.05)
    adapter = save_adapter(model, tmp_path / "adapter.safetensors")
    merged = tmp_path / "merged"
    res = CliRunner().invoke(cli, ["merge", str(ckpt.parent), str(adapter), "--out", str(merged), "-q"])
    assert res.exit_code == 0, res.output
    for name, source in (("copy16", ckpt), ("merged16", merged / "model.safetensors")):
        (tmp_path / name).mkdir()
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(source)).items()}
        save_file(tensors, str(tmp_path / name / "model.safetensors"))

    copy = audit(ckpt.parent, tmp_path / "copy16", bundle=bundle, tau=0.8)
    assert [r.delta_norm for r in copy] == [0.0] * len(copy) and {r.base_rounded_to for r in copy} == {"bfloat16"}
    exact = {r.module: r for r in audit(ckpt.parent, merged, bundle=bundle, tau=0.8)}
    assert all(r.frozen_row_share == 0.0 and r.protected_input_share < 1e-6 for r in exact.values())
    assert all(r.base_rounded_to is None for r in exact.values())
    for rec in audit(ckpt.parent, tmp_path / "merged16", bundle=bundle, tau=0.8):
        assert rec.frozen_row_share == 0.0, rec.module
        assert rec.delta_norm == pytest.approx(exact[rec.module].delta_norm, rel=2**-7)
        assert rec.protected_input_share < 1e-3  # the B rows' bf16 rounding only (chance is 0.38-0.61)
    res = CliRunner().invoke(cli, ["audit", str(ckpt.parent), str(tmp_path / "copy16"), "--bundle", str(bundle.path)])
    assert res.exit_code == 0 and "model: 0/3 modules changed" in res.output, res.output
    assert "note: TUNED stores 3 modules in bfloat16, which does not hold BASE's values exactly: dW = TUNED - BASE" in (
        res.output
    )
