"""audit as a user reads it: modules a fine-tune left unchanged have no share (they are not
shown as 0, PLATE's form), and a layer's experts share one heatmap cell by their energy-weighted share."""

from __future__ import annotations

import json
import re
import shutil

import torch
from click.testing import CliRunner
from oracles import load_all
from safetensors.torch import save_file

from plate_inspect.auditing import audit, table_cells
from plate_inspect.cli.main import cli
from plate_inspect.reports.audit import audit_figures, write_audit_report
from plate_inspect.testing.synthetic import write_family

EXPERT = "model.layers.0.block_sparse_moe.experts.{}.w1"


def tuned_copy(ckpt_path, out, names: list[str], seed: int = 0):
    """A copy of a one-file checkpoint with a dense random update on ``names``."""
    shutil.copytree(ckpt_path, out)
    tensors = load_all(ckpt_path)
    gen = torch.Generator().manual_seed(seed)
    for i, name in enumerate(names):
        w = tensors[f"{name}.weight"]
        tensors[f"{name}.weight"] = (w.float() + (i + 1) * 0.05 * torch.randn(w.shape, generator=gen)).to(w.dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_expert_cells_hold_their_energy_weighted_share_and_unchanged_modules_have_none(tmp_path):
    ckpt = write_family(tmp_path / "mixtral", "mixtral")
    changed = [EXPERT.format(0), EXPERT.format(2)]
    tuned = tuned_copy(ckpt.path, tmp_path / "tuned", changed)
    records = audit(ckpt.path, tuned, r=4)
    by_name = {r.module: r for r in records}
    assert {r.module for r in records if r.delta_norm > 0} == set(changed)
    figs = audit_figures(records)
    heat = figs["heatmap"]["data"][0]
    row, col = heat["y"].index("0"), heat["x"].index("block_sparse_moe.experts.w1")
    # the cell of layer 0's w1 experts: sum ||dW P||^2 / sum ||dW||^2 over its experts (the unchanged add nothing)
    num = sum(by_name[n].protected_input_share * by_name[n].delta_norm ** 2 for n in changed)
    den = sum(by_name[n].delta_norm ** 2 for n in changed)
    assert abs(heat["z"][row][col] - num / den) < 1e-12
    assert "modules, 2 changed" in heat["text"][row][col]
    # every other cell holds only unchanged modules: empty, not 0
    others = [z for i, zr in enumerate(heat["z"]) for j, z in enumerate(zr) if (i, j) != (row, col)]
    assert others and all(z is None for z in others)
    scatter = figs["scatter"]["data"][0]
    assert sorted(scatter["text"]) == sorted(changed)  # unchanged modules are not drawn at protected share 0
    assert f"({len(records) - 2} unchanged modules left out)" in figs["scatter"]["layout"]["title"]["text"]
    bars = figs["bars"]["data"][0]
    assert bars["x"] == sorted(changed, key=lambda n: -by_name[n].risk)
    assert bars["y"] == [by_name[n].risk for n in bars["x"]]
    title = figs["bars"]["layout"]["title"]["text"]
    assert f"highest 2 modules ({len(records) - 2} unchanged modules left out)" in title
    unchanged = next(r for r in records if r.delta_norm == 0)
    cells = table_cells(unchanged)
    assert cells[3] == "-" and cells[5] == "-" and cells[4] == f"{unchanged.chance_share:.4f}"
    page = write_audit_report(records, tmp_path / "audit.html").read_text()
    assert f"2 of {len(records)} modules changed. Energy-weighted protected input share" in page


def test_an_audit_of_a_model_against_itself_says_nothing_changed(tmp_path):
    ckpt = write_family(tmp_path / "mixtral", "mixtral")
    res = CliRunner().invoke(cli, ["audit", str(ckpt.path), str(ckpt.path), "--r", "4", "-q", "--top", "0"])
    assert res.exit_code == 0, res.output
    n = len(json.loads(CliRunner().invoke(cli, ["audit", str(ckpt.path), str(ckpt.path), "--r", "4", "--json"]).output))
    assert (
        f"model: 0/{n} modules changed: TUNED's weights equal BASE's in every audited module (no update to score; "
        "check that TUNED is the fine-tuned model)" in res.output
    )
    rows = [line.split() for line in res.output.splitlines() if line.strip().startswith("model.layers")]
    assert len(rows) == n and all(row[3] == "-" and row[5] == "-" for row in rows)
    bad = CliRunner().invoke(cli, ["audit", str(ckpt.path), str(ckpt.path), "--top", "-3"])
    assert bad.exit_code == 2 and re.search(r"--top.*-3", bad.output) and "Traceback" not in bad.output
