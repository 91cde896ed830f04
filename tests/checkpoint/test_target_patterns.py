"""`--target-modules` entries that select nothing while the others select something: a mistyped name (`v_porj`) or
an `lm_head` the model stores tied to its embedding was dropped without a word, and the bundle lacked the modules the
user meant to train. The scan goes on (a name list shared across families stays usable) and says which names matched
nothing, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_cli import run_cli
from safetensors.torch import load_file, save_file

from plate_inspect.scanner import ScanSettings, plan_scan
from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=2).path


@pytest.fixture(scope="module")
def tied(model, tmp_path_factory) -> Path:
    """The model saved as a tied-embedding checkpoint is: no lm_head tensor, tie_word_embeddings in config.json."""
    out = tmp_path_factory.mktemp("tied")
    tensors = {k: v for k, v in load_file(model / "model.safetensors").items() if not k.startswith("lm_head")}
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((model / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return out


def notes_and_modules(args, out: Path) -> tuple[list[str], set[str]]:
    code, output = run_cli("scan", *args, "--out", out, "--r", "4", "-q")
    assert code == 0 and "Traceback" not in output, output
    notes = [line for line in output.splitlines() if line.startswith("note:")]
    return notes, set(json.loads((out / "manifest.json").read_text())["modules"])


def test_a_mistyped_name_beside_a_good_one_is_named_in_a_note(model, tmp_path):
    notes, modules = notes_and_modules([model, "--target-modules", "q_proj,v_porj"], tmp_path / "b")
    assert modules == {f"model.layers.{i}.self_attn.q_proj" for i in range(2)}
    assert len(notes) == 1, notes
    assert "'v_porj' matched no module" in notes[0] and "self_attn.v_proj" in notes[0], notes  # the types to pick from
    assert "'q_proj'" not in notes[0]


def test_every_name_that_matches_gives_no_note(model, tmp_path):
    notes, modules = notes_and_modules([model, "--target-modules", "q_proj,v_proj,q_proj"], tmp_path / "b")
    assert len(modules) == 4 and notes == []


def test_a_name_outside_the_selected_layers_says_so(model, tmp_path):
    """A regex naming layer 1's q_proj with --layers 0: it matches a weight of the checkpoint, not of the selection."""
    notes, modules = notes_and_modules(
        [model, "--target-modules", r"v_proj,layers\.1\.self_attn\.q_proj", "--layers", "0"], tmp_path / "b"
    )
    assert modules == {"model.layers.0.self_attn.v_proj"}
    assert len(notes) == 1 and "matched no module of the selected layers" in notes[0], notes


def test_lm_head_of_a_tied_model_names_the_embedding(tied, tmp_path):
    notes, modules = notes_and_modules([tied, "--target-modules", "lm_head,q_proj"], tmp_path / "b")
    assert modules == {f"model.layers.{i}.self_attn.q_proj" for i in range(2)}
    assert len(notes) == 1 and "'lm_head' matched no module" in notes[0], notes
    assert "tied to the input embedding" in notes[0] and "'model.embed_tokens'" in notes[0], notes


def test_the_plan_carries_the_note_for_python_callers(model):
    plan = plan_scan(model, ScanSettings(target_modules=("o_proj", "q_porj")))
    assert [t.module_type for t in plan.targets] == ["self_attn.o_proj"] * 2
    assert len(plan.notes) == 1 and "'q_porj'" in plan.notes[0]
    assert plan_scan(model, ScanSettings(target_modules=("o_proj",))).notes == []


def test_a_weight_name_given_for_a_module_name_gets_the_hint(model, tmp_path):
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "--target-modules", "q_proj.weight", "-q")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, output
    assert "without '.weight'" in errors[0], errors
