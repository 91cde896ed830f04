"""What shapes an experiment's output, checked before the work: run_continual(console=3) failed with an
AttributeError after every run had finished; report_sequential(methods="lora") iterated the string (methods l, o,
r, a); variant_geometry(seed=None) was a RuntimeError from torch.manual_seed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from plate_inspect.errors import ConfigError
from plate_inspect.experiments.continual import ContinualSettings, run_continual
from plate_inspect.experiments.methods import Budget
from plate_inspect.experiments.sequential_tasks import report_sequential, run_sequential
from plate_inspect.train.variants import variant_geometry


@pytest.mark.parametrize("console", [3, "console", print])
def test_a_console_that_cannot_print_is_refused_before_any_run(tmp_path, console):
    tiny = replace(
        ContinualSettings(methods=("lora",), steps=(2,), stage1_steps=2), budgets={"lora": [Budget("r1", {"rank": 1})]}
    )
    with pytest.raises(ConfigError, match=r"^console must be a rich.console.Console or None, got "):
        run_continual(tmp_path / "out", seeds=1, settings=tiny, console=console)
    assert not (tmp_path / "out").exists()


def test_report_sequential_reads_one_method_name_as_one_method(tmp_path):
    run_sequential(tmp_path, ["lora", "osf"], seeds=1, steps=2)
    result = report_sequential(tmp_path, methods="lora")
    written = json.loads(result.path.read_text())
    assert list(written["matrices"]) == ["lora"]
    assert {r["method"] for r in written["records"]} == {"lora"} and len(written["records"]) == 10  # 1+2+3+4 cells
    with pytest.raises(ConfigError, match=r"^methods \(CLI: --methods\) must be a name or a list of names, got 3"):
        report_sequential(tmp_path, methods=3)
    with pytest.raises(ConfigError, match=r"^seeds must be integers in \[0, 2\^63\), got -1"):
        report_sequential(tmp_path, seeds=[-1])


def test_variant_geometry_names_a_bad_seed():
    weight, b_idx, q = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1]), torch.eye(4)[:, :2]
    with pytest.raises(ConfigError, match=r"^seed must be a non-negative integer below 2\^63, got None"):
        variant_geometry("random_b", weight, b_idx, q, torch.zeros(6), None)
    rows, kept_q = variant_geometry("random_b", weight, b_idx, q, torch.zeros(6), 5)
    assert kept_q is q and rows.numel() == 2 and len(set(rows.tolist())) == 2  # r rows, PLATE's Q kept
