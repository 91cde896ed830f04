"""A weight whose rows are all zero (block expansion's zero-initialised o_proj / down_proj, as LLaMA-Pro adds layers)
has no geometry: every input direction carries no energy, so Q is an arbitrary basis of the whole input space. The
scan's numbers read like any other module's; the summary says so."""

from __future__ import annotations

import json

import torch
from helpers_cli import run_cli
from safetensors.torch import load_file, save_file

from plate_inspect.testing.synthetic import write_llama_like

ZEROED = ("model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj")


def test_zero_initialised_modules_are_named_in_the_summary(tmp_path):
    model = write_llama_like(tmp_path / "m", layers=2).path
    tensors = load_file(model / "model.safetensors")
    code, output = run_cli("scan", model, "--out", tmp_path / "before", "--r", "4", "-q")
    assert code == 0 and "all zero" not in output, output  # the model as written: no note
    for name in ZEROED:
        tensors[f"{name}.weight"] = torch.zeros_like(tensors[f"{name}.weight"])
    save_file(tensors, str(model / "model.safetensors"))
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "--r", "4", "-q")
    assert code == 0, output
    modules = json.loads((tmp_path / "b" / "manifest.json").read_text())["modules"]
    for name in ZEROED:  # the oracle: W = 0 has no energy anywhere, so every input direction is a low-energy one
        assert modules[name]["total_energy"] == 0.0 and modules[name]["k"] == modules[name]["shape"][1]
    notes = [line for line in output.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "2 modules whose rows outside B are all zero" in notes[0], output
    assert ZEROED[1] in notes[0] or ZEROED[0] in notes[0]
    code, info = run_cli("info", tmp_path / "b")
    assert code == 0 and "2 modules whose rows outside B are all zero" in info, info
