"""Checkpoints that are part of a model: numbered shards without their index, some of them missing (a partial
download, a shard copied away), or layers missing against config.json's num_hidden_layers. Read as they were, they
scanned the layers that were there as if they were the whole model, with no word that layers were missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers_cli import run_cli
from safetensors.torch import load_file, save_file

from plate_inspect.checkpoint import INDEX_FILE, Checkpoint
from plate_inspect.errors import CheckpointError, CorruptCheckpointError
from plate_inspect.targets import select_targets
from plate_inspect.testing.synthetic import write_family, write_llama_like


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A 3-layer model in 4 numbered shards with its index (one layer a shard, the tail in the last)."""
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=3, max_shard_bytes=60_000).path


def without_index(sharded: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of the sharded model without its index, and without the shards named in ``drop``."""
    out = tmp_path / "copy"
    shutil.copytree(sharded, out)
    (out / INDEX_FILE).unlink()
    for name in drop:
        (out / name).unlink()
    return out


def test_the_fixture_has_four_numbered_shards(sharded):
    names = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def test_numbered_shards_with_one_missing_and_no_index_are_refused_naming_it(sharded, tmp_path):
    """Before: the directory opened with the 3 shards there and a scan wrote a complete bundle without layer 1."""
    model = without_index(sharded, tmp_path, drop=("model-00002-of-00004.safetensors",))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model)
    assert "shard model-00002-of-00004.safetensors missing" in str(e.value) and INDEX_FILE in str(e.value)
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "-q")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert "model-00002-of-00004.safetensors" in errors[0], errors
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_every_missing_shard_is_named(sharded, tmp_path):
    model = without_index(sharded, tmp_path, drop=tuple(f"model-0000{i}-of-00004.safetensors" for i in (1, 3, 4)))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(model)
    for i in (1, 3, 4):
        assert f"model-0000{i}-of-00004.safetensors" in str(e.value)
    assert "model-00002-of-00004.safetensors" not in str(e.value)


def test_all_numbered_shards_without_an_index_are_read_whole(sharded, tmp_path):
    """The check refuses only a gap: every shard there, the directory reads every tensor of every shard."""
    model = without_index(sharded, tmp_path)
    ckpt = Checkpoint.open(model)
    oracle = {}
    for f in sorted(model.glob("*.safetensors")):
        oracle.update(load_file(f))
    assert set(ckpt.tensors) == set(oracle)
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "--r", "4", "-q")
    assert code == 0, output
    modules = json.loads((tmp_path / "b" / "manifest.json").read_text())["modules"]
    assert {m["layer"] for m in modules.values()} == {0, 1, 2}


def test_unnumbered_files_without_an_index_are_read_as_before(sharded, tmp_path):
    """Shard-like names that do not count (other names, a number beyond the count) are not a shard set."""
    model = without_index(sharded, tmp_path)
    for i in range(1, 5):
        (model / f"model-0000{i}-of-00004.safetensors").rename(model / f"part{i}.safetensors")
    assert set(Checkpoint.open(model).tensors) == set(Checkpoint.open(sharded).tensors)


def test_one_numbered_shard_given_as_a_file_without_an_index_says_it_is_one_shard(sharded, tmp_path):
    model = without_index(sharded, tmp_path)
    shard = model / "model-00002-of-00004.safetensors"
    ckpt = Checkpoint.open(shard)
    assert set(ckpt.tensors) == set(load_file(shard))
    assert any("shard 2 of 4" in note for note in ckpt.notes), ckpt.notes


# --------------------------------------------------------------------------- layers against config.json
def with_config(model: Path, tmp_path: Path, **changes) -> Path:
    """A copy of a model directory with config.json's fields changed."""
    out = tmp_path / "changed"
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_layers_config_json_counts_but_the_weights_lack_are_refused(sharded, tmp_path):
    """Before: num_hidden_layers 5 over 3 stored layers scanned as a complete bundle of a 3-layer model."""
    model = with_config(sharded, tmp_path, num_hidden_layers=5)
    with pytest.raises(CorruptCheckpointError) as e:
        select_targets(Checkpoint.open(model))
    assert "num_hidden_layers 5" in str(e.value) and "layers 3-4 missing" in str(e.value), str(e.value)
    code, output = run_cli("scan", model, "--out", tmp_path / "b", "-q")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output


def test_a_layer_missing_in_the_middle_is_named(sharded, tmp_path):
    """Layer 1's tensors left out of a one-file copy (a partial conversion): refused, naming layer 1."""
    out = tmp_path / "gap"
    out.mkdir()
    tensors = {}
    for f in sorted(sharded.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(f).items() if not k.startswith("model.layers.1.")})
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(sharded / "config.json", out / "config.json")
    with pytest.raises(CorruptCheckpointError, match="layer 1 missing"):
        select_targets(Checkpoint.open(out))


def test_layers_beyond_config_jsons_count_are_refused(sharded, tmp_path):
    """num_hidden_layers 2 over 3 stored layers: transformers builds 2 and ignores layer 2's weights."""
    model = with_config(sharded, tmp_path, num_hidden_layers=2)
    with pytest.raises(CorruptCheckpointError, match="layer 2 beyond"):
        select_targets(Checkpoint.open(model))


def test_a_matching_count_and_deepseeks_extra_prediction_layer_pass(sharded, tmp_path):
    """The check's negatives: the model as written, DeepSeek's MTP layer (index num_hidden_layers, by design), a
    multimodal wrapper (text_config's count, the vision tower's layers not counted), one shard given alone."""
    assert len(select_targets(Checkpoint.open(sharded))[0]) == 21
    for family in ("deepseek_v3", "gemma3"):
        model = write_family(tmp_path / family, family, layers=2).path
        chosen, _ = select_targets(Checkpoint.open(model), include_mtp=True)
        assert {t.layer for t in chosen} >= {0, 1}, family
    chosen, _ = select_targets(Checkpoint.open(sharded / "model-00002-of-00004.safetensors"))
    assert {t.layer for t in chosen} == {1}


# --------------------------------------------------------------------------- an index that lists too little
def test_a_tensor_the_index_does_not_list_is_read_from_its_shard(sharded, tmp_path):
    """Before: a weight in a shard but not in the index's weight_map was left out, and its module with it (20 of 21
    modules, no word); transformers loads every tensor of the shards, so the scan reads it too, and says so."""
    model = tmp_path / "stale"
    shutil.copytree(sharded, model)
    index = json.loads((model / INDEX_FILE).read_text())
    shard = index["weight_map"].pop("model.layers.1.self_attn.q_proj.weight")
    (model / INDEX_FILE).write_text(json.dumps(index))
    ckpt = Checkpoint.open(model)
    assert ckpt.tensors["model.layers.1.self_attn.q_proj.weight"].file.name == shard
    assert set(ckpt.tensors) == set(Checkpoint.open(sharded).tensors)
    assert any(
        "does not list 1 tensor" in note and "model.layers.1.self_attn.q_proj.weight" in note for note in ckpt.notes
    )
    for source, out in ((model, tmp_path / "a"), (sharded, tmp_path / "b")):
        code, output = run_cli("scan", source, "--out", out, "--r", "4", "-q")
        assert code == 0, output
    manifests = [json.loads((out / "manifest.json").read_text()) for out in (tmp_path / "a", tmp_path / "b")]
    assert len(manifests[0]["modules"]) == 21
    assert manifests[0]["identity"] == manifests[1]["identity"]  # the same weights and settings as the intact model


def test_an_encoder_decoder_whose_decoder_is_shorter_is_not_refused(tmp_path):
    """distilbart-style: num_hidden_layers (the encoder's count) 3, decoder_layers 2; --layers decoder scans 2."""
    layers = {"model.encoder.layers": 3, "model.decoder.layers": 2}
    tensors = {f"{stack}.{i}.fc1.weight": torch.randn(24, 16) for stack, n in layers.items() for i in range(n)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {
        "model_type": "bart",
        "d_model": 16,
        "encoder_ffn_dim": 24,
        "decoder_ffn_dim": 24,
        "num_hidden_layers": 3,
        "encoder_layers": 3,
        "decoder_layers": 2,
        "is_encoder_decoder": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    chosen, _ = select_targets(Checkpoint.open(tmp_path), target_modules="fc1", layers=["decoder"])
    assert sorted(t.name for t in chosen) == ["model.decoder.layers.0.fc1", "model.decoder.layers.1.fc1"]
