"""``--layers`` naming layers the model does not have: a note names them, and the scan covers the ones it has.

``--layers 0-5`` on a 2-layer model scanned layers 0-1 without a word (a user reading the bundle later would take it
for the six layers asked for). A selection that keeps nothing is still refused. Oracle: the layers the test wrote.
"""

from __future__ import annotations

import pytest
from helpers_cli import assert_user_error, run_cli

from plate_inspect import Bundle
from plate_inspect.bundle import ScanSettings
from plate_inspect.scanner import plan_scan
from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=2).path


def _notes(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("note:")]


@pytest.mark.parametrize(
    ("layers", "note", "scanned"),
    [
        ("0-5", "--layers 0-5: layers 2-5 are not in this checkpoint (its layers: 0-1); scanning layers 0-1", {0, 1}),
        ("1,7", "--layers 1,7: layer 7 is not in this checkpoint (its layers: 0-1); scanning layers 1", {1}),
        ("0-1", None, {0, 1}),
    ],
)
def test_layers_the_model_lacks_are_named(two_layers, tmp_path, layers, note, scanned):
    code, output = run_cli("scan", two_layers, "--out", tmp_path / "b", "--r", "4", "--layers", layers, "-q")
    assert code == 0, output
    assert _notes(output) == ([f"note: {note}"] if note else []), output
    assert {rec.layer for rec in Bundle.load(tmp_path / "b")} == scanned


def test_the_note_is_the_plans_and_nothing_left_is_still_refused(two_layers, tmp_path):
    plan = plan_scan(two_layers, ScanSettings(r=4, layers=[0, 3]))
    assert plan.notes == ["--layers 0,3: layer 3 is not in this checkpoint (its layers: 0-1); scanning layers 0"]
    assert_user_error(["scan", two_layers, "--out", tmp_path / "b", "--layers", "4-5"], "no target modules matched")
