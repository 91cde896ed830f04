"""What ``plate-inspect verify`` prints for a bundle checked against another model: a few problem lines, a count of
the rest, and the one-line diagnosis still in view (--json keeps every problem)."""

from __future__ import annotations

import json

from helpers_cli import run_cli

from plate_inspect.cli.scan import PROBLEMS_SHOWN
from plate_inspect.testing.synthetic import write_llama_like


def test_a_bundle_of_other_weights_prints_a_capped_list_and_the_diagnosis(tmp_path):
    ours = write_llama_like(tmp_path / "ours", layers=2, seed=0).path
    theirs = write_llama_like(tmp_path / "theirs", layers=2, seed=1).path  # same names and shapes, other weights
    code, _ = run_cli("scan", ours, "--out", tmp_path / "b", "--r", "4", "--quiet")
    assert code == 0

    code, output = run_cli("verify", tmp_path / "b", theirs, "--quiet")
    assert code == 1
    problem_lines = [line for line in output.splitlines() if line.startswith("x ")]
    assert len(problem_lines) == PROBLEMS_SHOWN + 1, output
    assert problem_lines[-1] == f"x ... and {14 - PROBLEMS_SHOWN} more problems (--json lists every one)"
    assert "all 14 modules' weights differ" in output  # the diagnosis, after the list
    assert "FAILED: 14 problems in 14 modules" in output

    code, output = run_cli("verify", tmp_path / "b", theirs, "--json")
    assert code == 1
    assert len(json.loads(output)["problems"]) == 14
