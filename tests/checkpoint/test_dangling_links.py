"""A model file that is a symbolic link to nothing: a Hugging Face cache whose blob is missing (snapshots/COMMIT/FILE ->
../../blobs/HASH, the download interrupted or the cache pruned), or a hand-made link whose target moved.

It said "cannot read: No such file or directory; check the path" (the path was right), or, given as the file itself,
"neither an existing path nor a Hugging Face repo id". Now the link, its missing target and the mend are named: for a
cache, the ``hf download`` command that fetches the blob again (as a missing shard of a hub repo is worded).
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers_cli import assert_user_error

from plate_inspect.errors import dangling_link
from plate_inspect.testing.synthetic import write_llama_like

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=1).path


def _cache_snapshot(tmp_path, model, files, missing):
    """An HF cache layout: every file a link into blobs/, the blob of each name in ``missing`` absent."""
    repo = tmp_path / "hub" / "models--acme--tiny-llm"
    snapshot, blobs = repo / "snapshots" / COMMIT, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(files):
        blob = f"{i:040x}"
        if name not in missing:
            shutil.copy(model / name, blobs / blob)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    return snapshot


def test_a_cache_snapshot_with_its_blob_missing_names_the_fetch(tmp_path, model):
    snapshot = _cache_snapshot(tmp_path, model, ["config.json", "model.safetensors"], {"model.safetensors"})
    fetch = f"hf download acme/tiny-llm model.safetensors --revision {COMMIT}"
    for source in (snapshot, snapshot / "model.safetensors"):  # the directory, and the file given as such
        output = assert_user_error(
            ["scan", source, "--out", tmp_path / "b"],
            f"{snapshot / 'model.safetensors'}: cannot read: No such file or directory",
            "a link into the Hugging Face cache (../../blobs/",
            "whose blob is missing",
            fetch,
        )
        assert "check the path" not in output and "neither an existing path" not in output
    assert not (tmp_path / "b").exists()


def test_a_missing_shard_blob_is_named_by_the_index_error(tmp_path):
    sharded = write_llama_like(tmp_path / "sharded", layers=2, max_shard_bytes=60_000).path
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    files = ["config.json", "model.safetensors.index.json", *shards]
    snapshot = _cache_snapshot(tmp_path, sharded, files, {shards[1]})
    assert_user_error(
        ["scan", snapshot, "--out", tmp_path / "b"],
        f"names shard '{shards[1]}', which is missing; {shards[1]} is a link into the Hugging Face cache",
        f"hf download acme/tiny-llm {shards[1]} --revision {COMMIT}",
    )


def test_a_hand_made_dangling_link_names_its_target(tmp_path, model):
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(model / "config.json", local)
    (local / "model.safetensors").symlink_to(tmp_path / "moved" / "model.safetensors")
    assert_user_error(
        ["scan", local, "--out", tmp_path / "b"],
        f"{local / 'model.safetensors'}: cannot read: No such file or directory; it is a symbolic link to "
        f"{tmp_path / 'moved' / 'model.safetensors'}",
        "which does not exist: restore that file, or re-create the link",
    )


def test_dangling_link_is_none_for_anything_but_a_dangling_link(tmp_path, model):
    (tmp_path / "good").symlink_to(model / "config.json")
    assert dangling_link(model / "config.json") is None
    assert dangling_link(tmp_path / "good") is None
    assert dangling_link(tmp_path / "absent") is None
    (tmp_path / "bad").symlink_to("nowhere")
    assert dangling_link(tmp_path / "bad") == (
        f"it is a symbolic link to nowhere ({tmp_path / 'nowhere'}), which does not exist: restore that file, or "
        "re-create the link"
    )
