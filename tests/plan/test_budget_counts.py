"""An absolute --budget is the count written, however large: it was read as a float, so a count past 2^53 changed
('123456789012345678' planned 123456789012345680 parameters) and '1e30' was recorded in the plan file as
1000000000000000019884624838656. Checked against Python's exact integers."""

from __future__ import annotations

import json

import pytest
from helpers_cli import run_cli

from plate_inspect.errors import ConfigError
from plate_inspect.plan import parse_budget


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("123456789012345678", 123456789012345678),
        ("123,456,789,012,345,678", 123456789012345678),
        ("1e30", 10**30),
        ("9007199254740993", 2**53 + 1),  # the first integer a float cannot hold
        ("2.5e1", 25),
        ("1e308", 10**308),
    ],
)
def test_an_absolute_budget_is_the_exact_count(text, count):
    budget = parse_budget(text, [])
    assert budget.kind == "absolute"
    assert budget.params == count
    assert budget.value == float(count)


@pytest.mark.parametrize("text", ["1e309", "1e5000", "1.5", "2.5e-1", "nan", "-inf", "0", "1e-3"])
def test_what_is_no_whole_count_in_range_is_still_refused(text):
    with pytest.raises(ConfigError, match="not a budget"):
        parse_budget(text, [])


def test_the_plan_file_records_the_count_written(three_r_bundle, tmp_path):
    out = tmp_path / "plan.json"
    code, output = run_cli("plan", three_r_bundle.path, "--budget", "123456789012345678", "-o", out)
    assert code == 0, output
    budget = json.loads(out.read_text())["budget"]
    assert budget["params"] == 123456789012345678
    assert budget["limited_by_bundle"] and budget["spent"] == budget["capacity"] < budget["params"]
