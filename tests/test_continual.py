"""The continual-learning benchmark: --quick through the CLI writes a well-formed results.json, table and HTML."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from plate_inspect.bundle import Bundle
from plate_inspect.cli.main import cli
from plate_inspect.errors import ConfigError
from plate_inspect.experiments.continual import METHODS, RECORD_KEYS, symmetric_kl, validate_records


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("continual")
    result = CliRunner().invoke(cli, ["experiment", "continual", "--out", str(out), "--quick", "--no-progress"])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_quick_results_json_is_well_formed(quick_run):
    out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    validate_records(data)
    assert {rec["method"] for rec in data} == set(METHODS)
    for rec in data:
        assert tuple(sorted(rec)) == tuple(sorted(RECORD_KEYS))
        assert rec["seed"] == 0
        assert all(0.0 <= rec[k] <= 1.0 for k in ("task1_acc_before", "task1_acc_after", "task2_acc"))
    by = {rec["method"]: rec for rec in data}
    assert by["full_ft"]["trainable_params"] == 148_224 and by["full_ft"]["trainable_pct"] == 100.0
    rank = by["lora"]["config"]["rank"]
    assert by["lora"]["config"]["alpha"] == 0.5 * rank
    assert by["lora"]["trainable_params"] == rank * (64 + 256) + 2 * rank * (256 + 256)  # LoRA A and B on fc1..fc3
    cfg = by["plate"]["config"]
    bundle = Bundle.load(out / "seed0" / f"bundle_r{cfg['r']}_tau{cfg['tau']:g}")
    assert by["plate"]["trainable_params"] == sum(rec.r * rec.k for rec in bundle)
    for v in ("random_b", "least_redundant_b", "random_q", "high_energy_q", "random_bq"):
        assert by[f"plate_{v}"]["trainable_params"] == by["plate"]["trainable_params"]  # matched capacity
        assert by[f"plate_{v}"]["config"]["variant"] == v
    assert len({rec["task1_acc_before"] for rec in data}) == 1  # one stage-1 model per seed
    # the stage-1 checkpoint is safetensors and every bundle came from the scanner
    assert (out / "seed0" / "stage1.safetensors").exists()
    assert bundle.manifest.settings.target_modules == ("fc1", "fc2", "fc3")


def test_quick_outputs_table_and_self_contained_html(quick_run):
    out, output = quick_run
    assert "plate_random_bq" in output and "±" in output
    html = (out / "continual.html").read_text()
    assert 'src="https://cdn.plot.ly' not in html
    assert len(html) > 1_000_000  # plotly.js is inlined
    assert "Task-1 forgetting" in html
    assert (out / "summary.md").read_text().startswith("| method |")


def test_symmetric_kl_hand_computed():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5], [0.6, 0.4]], dtype=torch.float64)
    kl = symmetric_kl(p.log(), q.log())
    row2 = 0.5 * (0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4) + 0.6 * math.log(0.6 / 0.9) + 0.4 * math.log(4))
    assert kl == pytest.approx(row2 / 2, rel=1e-9)
    assert symmetric_kl(q.log(), p.log()) == pytest.approx(kl, rel=1e-12)
    assert symmetric_kl(p.log(), p.log() + 3.0) == pytest.approx(0.0, abs=1e-12)  # logits shift-invariant


def test_validate_records_rejects_malformed():
    good = {
        "method": "plate",
        "config": {},
        "seed": 0,
        "trainable_params": 10,
        "trainable_pct": 1.0,
        "task1_acc_before": 0.9,
        "task1_acc_after": 0.8,
        "task2_acc": 0.7,
        "kl_task1": 0.01,
    }
    validate_records([good])
    for bad in ({**good, "task2_acc": 95.0}, {**good, "method": "adapter"}, {k: good[k] for k in list(good)[:-1]}):
        with pytest.raises(ConfigError):
            validate_records([bad])
