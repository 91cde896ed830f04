"""A device the machine cannot run is refused before the checkpoint is opened: opening a hub model downloads its
weights, and `scan Org/Big --device cuda` on a machine without a GPU said "no CUDA device" only after the download
(as a mistyped --out did before --out was checked first)."""

from __future__ import annotations

import pytest
import torch
from helpers_cli import run_cli

import plate_inspect.scanner as scanner
from plate_inspect.errors import ConfigError
from plate_inspect.testing.synthetic import write_llama_like

# refused on every machine: not a device kind plate-inspect runs on, or two ways of naming devices at once
REFUSED = [("--device", "mps"), ("--device", "gpu"), ("--devices", "cpu,cpu", "--device", "cuda:0")]
if not torch.cuda.is_available():
    REFUSED += [("--device", "cuda"), ("--devices", "all")]


@pytest.mark.parametrize("args", REFUSED)
def test_the_cli_refuses_the_device_before_opening_the_model(tmp_path, monkeypatch, args):
    model = write_llama_like(tmp_path / "m", layers=1).path
    opened = []
    monkeypatch.setattr(scanner.Checkpoint, "open", lambda *a, **k: opened.append(a) or pytest.fail("opened"))
    code, output = run_cli("scan", model, "--out", tmp_path / "b", *args, "-q")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert "device" in errors[0], errors
    assert opened == [] and "target module" not in output


def test_the_api_refuses_the_device_before_opening_the_model(tmp_path):
    """A model that does not exist: the device error comes first (the model's would have come first before)."""
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N, got 'mps'"):
        scanner.scan(tmp_path / "no-such-model", tmp_path / "b", device="mps")
