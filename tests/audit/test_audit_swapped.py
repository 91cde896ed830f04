"""audit BASE TUNED given the other way round: a bf16 BASE that is exactly the fp32 TUNED rounded to bf16 is a
lower-precision copy of TUNED, not the model TUNED was fine-tuned from; the audit says so (CLI, JSON, report)."""

from __future__ import annotations

import json

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
