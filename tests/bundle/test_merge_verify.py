"""``merge``, ``verify`` and ``info`` as a user runs them after training: merge --overwrite keeps no stale index and
no adapter kept in --out is deleted, remote-code files are copied; verify says what its fingerprint failures mean
together, and why a share of the exactness allowance above one is ok for a bf16 Q."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from helpers_train import dense_plate_weight, randomize_adapters, skeleton
from oracles import load_all
from safetensors.torch import load_file, save_file

from plate_inspect import scan, verify
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.cli.main import cli
from plate_inspect.errors import BundleError
from plate_inspect.testing.synthetic import write_gpt2, write_llama_like
from plate_inspect.train.layer import apply_bundle, save_adapter
from plate_inspect.train.sequential import merge_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, sharded source, the same weights as one file, bundle, adapter file, model holding the PLATE layers)."""
    root = tmp_path_factory.mktemp("mergeqa")
    sharded = write_llama_like(root / "sharded", layers=1, max_shard_bytes=20_000).path
    single = write_llama_like(root / "single", layers=1).path  # same seed: the same tensors, one file
    assert (sharded / "model.safetensors.index.json").exists() and (single / "model.safetensors").exists()
    bundle = scan(sharded, root / "bundle", r=8, tau=0.8, max_rank=32)
    model = skeleton(sharded, bundle.modules)
    randomize_adapters(apply_bundle(model, bundle), seed=5, scale=0.05)
    return root, sharded, single, bundle, save_adapter(model, root / "adapter.safetensors"), model


def _oracle(source, model, bundle) -> dict[str, torch.Tensor]:
    """The merged checkpoint by the float64 dense oracle W + rho E_B A Q^T, rounded once to the stored dtype."""
    tensors = load_all(source)
    for m in bundle.modules:
        layer, w = model.get_submodule(m), tensors[f"{m}.weight"]
        merged = dense_plate_weight(w, layer.plate_B_idx, layer.plate_A.detach(), layer.plate_Q, 0.5)
        tensors[f"{m}.weight"] = merged.to(w.dtype)
    return tensors


def test_overwrite_single_file_merge_over_a_sharded_one_leaves_no_stale_index(trained, tmp_path):
    """QA: --overwrite removed the old shards but kept their index: the merged dir then named missing shards and
    could not be opened (``verify``, ``--rescan`` and the next merge failed)."""
    _, sharded, single, bundle, adapter, model = trained
    out = tmp_path / "merged"
    merge_checkpoint(sharded, adapter, out)
    assert (out / "model.safetensors.index.json").exists()
    merge_checkpoint(single, adapter, out, overwrite=True)
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    opened = Checkpoint.open(out)
    assert [f.name for f in opened.files] == ["model.safetensors"]
    got, expect = load_all(out), _oracle(single, model, bundle)
    assert sorted(got) == sorted(expect)
    for name, t in expect.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_overwrite_keeps_other_safetensors_in_out(trained, tmp_path):
    """QA: --overwrite deleted every *.safetensors the new merge did not write: the adapter kept beside the merged
    model was gone. Only the old checkpoint's own files (its index's shards, save_pretrained's names) go."""
    _, sharded, single, _, adapter, _ = trained
    out = tmp_path / "task1"
    merge_checkpoint(sharded, adapter, out)
    shutil.copy(adapter, out / "adapter.safetensors")
    kept = (out / "adapter.safetensors").read_bytes()
    result = CliRunner().invoke(
        cli, ["merge", str(single), str(out / "adapter.safetensors"), "--out", str(out), "--overwrite", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["adapter.safetensors", "model.safetensors"]
    assert (out / "adapter.safetensors").read_bytes() == kept
    assert not (out / "model.safetensors.index.json").exists()


def test_remote_code_files_are_copied(trained, tmp_path):
    """QA: a trust_remote_code model's configuration_*.py / modeling_*.py (named by config.json's auto_map) were not
    copied, so from_pretrained(out, trust_remote_code=True) failed on the merged model."""
    _, sharded, _, _, adapter, _ = trained
    src = tmp_path / "remote"
    shutil.copytree(sharded, src)
    code = {"configuration_mine.py": "class MineConfig: ...\n", "modeling_mine.py": "class MineModel: ...\n"}
    for name, text in code.items():
        (src / name).write_text(text)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_mine.MineConfig", "AutoModel": "modeling_mine.MineModel"}
    (src / "config.json").write_text(json.dumps(config))
    merge_checkpoint(src, adapter, tmp_path / "out")
    for name, text in code.items():
        assert (tmp_path / "out" / name).read_text() == text
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"] == config["auto_map"]


def test_verify_names_changed_modules_and_says_what_it_means(trained, tmp_path):
    """A fine-tuned model (one weight changed) and a merged one (every adapted weight changed): report.changed
    names exactly those modules, one note says what that means and what to do; the CLI exits 1 and prints it."""
    _, sharded, _, bundle, adapter, _ = trained
    tuned = tmp_path / "tuned"
    shutil.copytree(sharded, tuned)
    index = json.loads((tuned / "model.safetensors.index.json").read_text())["weight_map"]
    target = bundle.modules[2]
    shard = tuned / index[f"{target}.weight"]
    tensors = load_file(str(shard))
    tensors[f"{target}.weight"] = tensors[f"{target}.weight"].clone()
    tensors[f"{target}.weight"][0, 0] += 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report = verify(bundle, tuned)
    assert report.changed == [target] and report.absent == []
    diagnosis = [n for n in report.notes if "differ" in n]
    assert len(diagnosis) == 1 and diagnosis[0].startswith(f"1 of {len(bundle)} modules' weights differ")
    merged = merge_checkpoint(sharded, adapter, tmp_path / "merged").out
    report = verify(bundle, merged)
    assert sorted(report.changed) == sorted(bundle.modules)
    assert any(n.startswith(f"all {len(bundle)} modules' weights differ") for n in report.notes)
    result = CliRunner().invoke(cli, ["verify", str(bundle.path), str(merged)], terminal_width=400)
    assert result.exit_code == 1
    assert f"all {len(bundle)} modules' weights differ" in result.output and "Traceback" not in result.output
    assert verify(bundle, sharded).notes == []  # the right model: no diagnosis


def test_verify_against_another_architecture_says_so(trained, tmp_path):
    """A Qwen2 bundle against a GPT-2 checkpoint: no module has a weight there; one note says it is another model
    (and the model_type note no longer points at fingerprint checks 'below' that never ran)."""
    _, _, _, bundle, _, _ = trained
    gpt2 = write_gpt2(tmp_path / "gpt2").path
    report = verify(bundle, gpt2)
    assert sorted(report.absent) == sorted(bundle.modules) and report.changed == []
    assert any(f"has a weight for none of the bundle's {len(bundle)} modules" in n for n in report.notes)
    assert not any("below" in n for n in report.notes)
    _, sharded, _, _, _, _ = trained
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sharded / index["lm_head.weight"]  # one shard of the right model: not "another model"
    assert any(index[f"{m}.weight"] != shard.name for m in bundle.modules)
    report = verify(bundle, shard)
    assert report.absent and report.notes == [
        f"{shard} is one shard of a sharded model ({len(report.absent)} of the bundle's {len(bundle)} modules have "
        f"no weight in it): verify against the model's directory, {sharded}"
    ]


def test_merged_files_are_synced_before_they_are_moved_into_place(trained, tmp_path, monkeypatch):
    """QA: save_file does not fsync; a crash (power loss) after the rename could leave a complete-looking --out of
    empty or truncated shards. Every written file and the temp dir are fsynced before the rename."""
    import os

    _, sharded, _, _, adapter, _ = trained
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    moved: list[str] = []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(a, b):
        moved.append(str(a))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "merged"
    merge_checkpoint(sharded, adapter, out)
    assert len(moved) == 1  # the temp dir, renamed to out in one step
    tmp = moved[0]
    written = {p.name for p in out.iterdir()}
    synced_before = {os.path.basename(p) for p in synced if os.path.dirname(p) == tmp}
    assert written <= synced_before, written - synced_before
    assert tmp in synced and str(tmp_path) in synced  # the temp dir's entries, then the rename in its parent


def test_merge_refuses_to_replace_other_files_in_out_without_overwrite(trained, tmp_path):
    """QA: only safetensors files in --out were checked: ``--out .`` in a project silently replaced its config.json
    (and tokenizer/JSON files). Files the merge would replace now need --overwrite; nothing is written."""
    _, sharded, _, _, adapter, _ = trained
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"mine": 1}')
    (project / "notes.md").write_text("keep")
    result = CliRunner().invoke(cli, ["merge", str(sharded), str(adapter), "--out", str(project), "-q"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "already holds config.json" in result.output and "--overwrite" in result.output
    assert (project / "config.json").read_text() == '{"mine": 1}'
    assert sorted(p.name for p in project.iterdir()) == ["config.json", "notes.md"]
    assert sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name) == []
    merge_checkpoint(sharded, adapter, project, overwrite=True)  # asked for: replaced, the other file kept
    assert json.loads((project / "config.json").read_text()) == json.loads((sharded / "config.json").read_text())
    assert (project / "notes.md").read_text() == "keep"


def test_single_file_source_in_its_own_directory_gets_its_tokenizer_files(trained, tmp_path):
    """QA: merging ``dir/model.safetensors`` copied config.json only, so AutoTokenizer.from_pretrained(out) and the
    generation config were lost; a file alone in its model directory now brings that directory's files along."""
    _, _, single, _, adapter, _ = trained
    src = tmp_path / "model"
    shutil.copytree(single, src)
    extra = {
        "tokenizer.json": '{"version": "1.0"}',
        "tokenizer_config.json": "{}",
        "generation_config.json": '{"max_new_tokens": 5}',
        "chat_template.jinja": "{{ messages }}",
    }
    for name, text in extra.items():
        (src / name).write_text(text)
    merge_checkpoint(src / "model.safetensors", adapter, tmp_path / "out")
    for name, text in extra.items():
        assert (tmp_path / "out" / name).read_text() == text
    crowded = tmp_path / "downloads"  # a file among others: config.json only, as before
    shutil.copytree(src, crowded)
    shutil.copy(adapter, crowded / "adapter.safetensors")
    merge_checkpoint(crowded / "model.safetensors", adapter, tmp_path / "out2")
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["config.json", "model.safetensors"]


def test_moved_bundle_says_to_pass_its_new_place(trained, tmp_path):
    """QA: an adapter whose bundle was moved got 'does not exist; create a bundle with: plate-inspect scan ...': a new
    scan is not the bundle it was trained with. The error now says to pass the bundle's new place (--bundle)."""
    _, sharded, _, bundle, adapter, _ = trained
    moved = tmp_path / "moved-bundle"
    bundle.path.rename(moved)
    try:
        with pytest.raises(BundleError, match=r"is not there \(moved or deleted\?\); pass its new place as bundle=DIR"):
            merge_checkpoint(sharded, adapter, tmp_path / "out")
        result = CliRunner().invoke(cli, ["merge", str(sharded), str(adapter), "-o", str(tmp_path / "out")])
        assert result.exit_code == 2 and "pass its new place as --bundle" in result.output
        assert "Traceback" not in result.output and not (tmp_path / "out").exists()
        merged = merge_checkpoint(sharded, adapter, tmp_path / "out", bundle=moved)
        assert sorted(merged.merged_modules) == sorted(bundle.modules)
    finally:
        moved.rename(bundle.path)


def test_info_on_an_adapter_points_to_its_bundle(trained, tmp_path):
    """QA: ``info adapter.safetensors`` said to scan the adapter as a model, and ``info`` of a PEFT adapter directory
    called it a model checkpoint. Both now name the bundle the adapter was trained with (a model file: as before)."""
    _, sharded, _, bundle, adapter, _ = trained
    runner = CliRunner()
    result = runner.invoke(cli, ["info", str(adapter)], terminal_width=400)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "a PLATE adapter (save_adapter), not a bundle" in result.output
    assert f"plate-inspect info {bundle.path}" in result.output and "scan" not in result.output
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    (peft_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "PLATE", "bundle": str(bundle.path)}))
    save_file({"x": torch.zeros(1)}, str(peft_dir / "adapter_model.safetensors"))
    result = runner.invoke(cli, ["info", str(peft_dir)], terminal_width=400)
    assert result.exit_code == 2 and "a PEFT adapter of the plate method" in result.output
    assert f"plate-inspect info {bundle.path}" in result.output and "model checkpoint" not in result.output
    shard = sorted(sharded.glob("*.safetensors"))[0]  # a model file: still told how to scan one
    result = runner.invoke(cli, ["info", str(shard)], terminal_width=400)
    assert result.exit_code == 2 and "plate-inspect scan" in result.output and "adapter" not in result.output
    assert runner.invoke(cli, ["info", str(bundle.path)]).exit_code == 0


def test_merge_names_what_a_killed_merge_left_behind(trained, tmp_path):
    """QA: a SIGKILLed merge leaves its hidden temporary directory (as large as the model) beside --out, and nothing
    said so. The next merge into the same --out notes it (it never deletes it: another merge may be writing it)."""
    _, sharded, _, _, adapter, _ = trained
    leftover = tmp_path / ".merged.partial-0123456789ab"
    leftover.mkdir()
    (leftover / "model-00001-of-00002.safetensors").write_bytes(b"x" * 2048)
    out = tmp_path / "merged"
    result = CliRunner().invoke(cli, ["merge", str(sharded), str(adapter), "--out", str(out), "-q"], terminal_width=400)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # rich wraps long lines at the console's width
    assert f"1 temporary directory of an interrupted merge into {out} (2.05 KB: {leftover})" in said
    assert leftover.is_dir() and (out / "config.json").exists()
    clean = CliRunner().invoke(cli, ["merge", str(sharded), str(adapter), "--out", str(tmp_path / "m2"), "-q"])
    assert clean.exit_code == 0 and "interrupted" not in clean.output


def test_merge_uses_the_q_the_adapter_was_trained_with(trained, tmp_path):
    """QA: an adapter trained with Q held in bf16 (apply_bundle(q_dtype=torch.bfloat16)) was merged with the bundle's
    float32 Q: 1253 bf16 weight entries differed from the in-model merge (up to 3.9e-3). The merge now uses the Q the
    layer held: the float64 oracle with that Q, rounded once to bf16, and unload(model) bit for bit."""
    from plate_inspect.train.layer import unload

    _, sharded, _, bundle, _, _ = trained
    model = skeleton(sharded, bundle.modules)
    randomize_adapters(apply_bundle(model, bundle, q_dtype=torch.bfloat16), seed=7, scale=0.5)
    adapter = save_adapter(model, tmp_path / "adapter_bf16q.safetensors")
    got = load_all(merge_checkpoint(sharded, adapter, tmp_path / "out").out)
    source = load_all(sharded)
    for m in bundle.modules:
        layer, w = model.get_submodule(m), source[f"{m}.weight"]
        assert layer.plate_Q.dtype == torch.bfloat16
        held_q = bundle.q(m)[:, : layer.plate_A.shape[1]].to(torch.bfloat16)
        expect = dense_plate_weight(w, bundle.b_idx(m), layer.plate_A.detach(), held_q, 0.5).to(w.dtype)
        assert torch.equal(got[f"{m}.weight"], expect), m
    merged_model = unload(model)
    for m in bundle.modules:
        assert torch.equal(got[f"{m}.weight"], merged_model.get_submodule(m).weight), m


def test_verify_json_is_the_report_for_scripts_with_the_same_exit_codes(trained, tmp_path):
    """`verify --json`: stdout is one JSON document (no progress bar, no rich markup) holding the report's fields,
    `ok` and, with --exact, each module's share of the exactness allowance; exit 0 / 1 as without it."""
    _, sharded, _, bundle, adapter, _ = trained
    runner = CliRunner()
    result = runner.invoke(cli, ["verify", str(bundle.path), str(sharded), "--exact", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["ok"] is True and data["problems"] == [] and data["modules_checked"] == len(bundle)
    assert sorted(data["exactness"]) == sorted(bundle.modules)
    for check in data["exactness"].values():
        assert check["ok"] is True and check["used"] <= 1.0 and check["energy"] >= 0
        assert check["used"] == pytest.approx((check["energy"] - check["optimum"]) / check["allowance"])
    merged = merge_checkpoint(sharded, adapter, tmp_path / "merged").out
    result = runner.invoke(cli, ["verify", str(bundle.path), str(merged), "--json"])
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["ok"] is False and sorted(data["changed"]) == sorted(bundle.modules) and data["absent"] == []
    assert len(data["problems"]) == len(bundle)


def test_verify_exact_says_why_a_share_above_one_is_ok(tmp_path):
    """QA: `verify --exact` of a bundle scanned with --q-dtype bfloat16 printed "largest share of the allowance
    used: 2.2" and then "ok", with no reason. The check allows for Q's storage rounding (a bf16 Q's energy can
    exceed an optimum of ~0 by its rounding alone): the line now says so; a float32 bundle's line does not."""
    ckpt = write_llama_like(tmp_path / "ckpt", layers=1).path
    runner = CliRunner()
    for q_dtype in ("bfloat16", "float32"):
        out = tmp_path / q_dtype
        assert runner.invoke(cli, ["scan", str(ckpt), "--out", str(out), "--q-dtype", q_dtype, "-q"]).exit_code == 0
        result = runner.invoke(cli, ["verify", str(out), str(ckpt), "--exact", "--json"])
        assert result.exit_code == 0, result.output
        worst = max(m["used"] for m in json.loads(result.stdout)["exactness"].values())
        text = runner.invoke(cli, ["verify", str(out), str(ckpt), "--exact"])
        assert text.exit_code == 0 and "ok: 7 modules verified" in text.output, text.output
        said = "(over 1, but within the rounding of Q's stored dtype" in " ".join(text.output.split())
        assert (worst > 1, said) == ((True, True) if q_dtype == "bfloat16" else (False, False)), (worst, text.output)
