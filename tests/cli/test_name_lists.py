"""A comma-separated name list that names nothing (`--target-modules ,`: unset shell variables joined by commas) is
refused in one line by every command that takes one; read as no value, it selected the default modules."""

from __future__ import annotations

import pytest
from helpers_cli import run_cli

from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=1).path


@pytest.mark.parametrize("value", [",", " , ", ",,,"])
@pytest.mark.parametrize("command", ["scan", "audit"])
def test_a_name_list_of_only_commas_is_refused(model, tmp_path, command, value):
    args = ["scan", model, "--out", tmp_path / "b"] if command == "scan" else ["audit", model, model]
    code, output = run_cli(*args, "--target-modules", value, "-q")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert "--target-modules" in errors[0] and "names no module" in errors[0], errors
    assert not (tmp_path / "b").exists()


def test_empty_entries_beside_names_are_dropped(model, tmp_path):
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "--target-modules", ",q_proj,", "--r", "4", "-q")
    assert code == 0 and "computed 1 of 1 modules" in output, output
