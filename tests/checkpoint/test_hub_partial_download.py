"""A hub repo is downloaded only as far as the scan reads it.

Mistral repos ship ``consolidated.safetensors`` (the whole model, in Mistral's own tensor names) beside
``model-0000x-of-0000y.safetensors`` + index; the download's ``*.safetensors`` pattern fetched both, twice the size
of a 100+ GB model, though the reader (like transformers) opens the index's shards only. Now the ``*.json`` files
come first, then the weight files the reader will open (:func:`plate_inspect.checkpoint.hub_weight_files`).

Two stand-ins for the hub, no network: the real huggingface_hub client against helpers_hub's HTTP stand-in on
127.0.0.1 (its file table swapped), and an in-process fake of ``snapshot_download``/``list_repo_files`` that
materialises a local directory as a cached snapshot (filtering with huggingface_hub's own pattern matcher) and
records what was asked for, so that the scan of the repo id can be compared with the scan of the directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helpers_hub
import huggingface_hub
import pytest
import torch
from helpers_hub import COMMIT, StandInHub, endpoint_of, open_in_fresh_process
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file, save, save_file

from plate_inspect import scan
from plate_inspect.checkpoint import INDEX_FILE, hub_weight_files
from plate_inspect.testing.synthetic import write_llama_like

UP = "model.layers.0.mlp.up_proj.weight"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_hub_weight_files_is_the_readers_rule():
    """Hand-made cases of which weight files a directory is read from (Checkpoint.open's and transformers' rule)."""
    index = {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}
    mistral = [*SHARDS, INDEX_FILE, "consolidated.safetensors", "params.json", "config.json"]
    assert hub_weight_files(mistral, index) == SHARDS
    assert hub_weight_files([*mistral, "model.safetensors"], index) == ["model.safetensors"]  # loaded first
    assert hub_weight_files(["model.safetensors", INDEX_FILE], {"a.weight": "model.safetensors"}) == [
        "model.safetensors"
    ]  # an index naming model.safetensors: an ordinary (one-shard) index
    assert hub_weight_files(["model.safetensors", "consolidated.safetensors"], None) == ["model.safetensors"]
    assert hub_weight_files(["consolidated.safetensors", "original/x.safetensors", "config.json"], None) == [
        "consolidated.safetensors"
    ]  # no index, no model.safetensors: every top-level file (a subfolder is never read)


# --------------------------------------------------------------------------- the real client, the HTTP stand-in
def _st(value: float) -> bytes:
    return save({UP: torch.full((4, 3), value)})


def _mistral_files(with_single: bool) -> dict[str, bytes]:
    files = {
        "config.json": json.dumps({"model_type": "mistral"}).encode(),
        "params.json": json.dumps({"dim": 3}).encode(),
        INDEX_FILE: json.dumps({"weight_map": {UP: SHARDS[0], "lm_head.weight": SHARDS[1]}}).encode(),
        SHARDS[0]: _st(1.0),
        SHARDS[1]: save({"lm_head.weight": torch.zeros(2, 3)}),
        "consolidated.safetensors": save({"layers.0.feed_forward.w3.weight": torch.full((4, 3), 9.0)}),
        "README.md": b"# card\n",
    }
    if with_single:
        files["model.safetensors"] = _st(2.0)
    return files


@pytest.mark.parametrize("with_single", [False, True], ids=["shards+consolidated", "model.safetensors+shards"])
def test_download_fetches_only_the_files_the_reader_opens(hub, tmp_path, monkeypatch, with_single):
    files = _mistral_files(with_single)
    monkeypatch.setattr(helpers_hub, "FILES", files)  # the stand-in serves this repo as org/model
    home = tmp_path / "hf-home"
    (first,) = open_in_fresh_process([("org/model", None, None)], home, endpoint_of(hub))
    assert first["ok"], first
    asked = [path for _, path in StandInHub.requests]
    assert not any("consolidated" in p for p in asked), asked
    fetched = {p.rsplit("/", 1)[-1] for p in asked if "/resolve/" in p}
    weights = ["model.safetensors"] if with_single else SHARDS
    assert fetched == {"config.json", "params.json", INDEX_FILE, *weights}
    assert first["files"] == sorted({"config.json", "params.json", INDEX_FILE, *weights})
    assert first["sum"] == (24.0 if with_single else 12.0)  # model.safetensors (2.0) is what transformers loads
    assert first["commit"] == COMMIT and len(asked) < 25

    endpoint = endpoint_of(hub)
    hub.shutdown()
    hub.server_close()
    n = len(StandInHub.requests)
    again, offline = open_in_fresh_process([("org/model", None, None), ("org/model", None, True)], home, endpoint)
    assert again == first and offline == first  # the cache is complete as it is: no hub needed, nothing missing
    assert len(StandInHub.requests) == n


# --------------------------------------------------------------------------- in-process fake: scan equality
class FakeHub:
    """``snapshot_download`` and ``list_repo_files`` for one repo made from a local directory; records calls."""

    def __init__(self, repo: Path, cache: Path):
        self.repo, self.cache = repo, cache
        self.calls: list[tuple[list[str] | None, bool]] = []
        self.fetched: list[str] = []
        self.listed = 0

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.repo).as_posix() for p in self.repo.rglob("*") if p.is_file())

    def snapshot_download(self, repo_id, *, revision=None, allow_patterns=None, local_files_only=False, **kw):
        assert repo_id == "acme/mistral" and revision in (None, "main", COMMIT), (repo_id, revision)
        self.calls.append((list(allow_patterns) if allow_patterns else None, local_files_only))
        snap = self.cache / COMMIT
        if local_files_only:
            if not snap.is_dir():
                raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
            return str(snap)
        for name in filter_repo_objects(self.files(), allow_patterns=allow_patterns):
            target = snap / name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.repo / name, target)
                self.fetched.append(name)
        return str(snap)

    def list_repo_files(self, repo_id, *, revision=None, **kw):
        assert repo_id == "acme/mistral" and revision == COMMIT
        self.listed += 1
        return self.files()


@pytest.fixture
def mistral_repo(tmp_path) -> Path:
    """A sharded synthetic model (index + 2+ shards) with a Mistral-style consolidated.safetensors beside it."""
    repo = write_llama_like(tmp_path / "repo", model_type="mistral", layers=2, max_shard_bytes=40_000).path
    assert (repo / INDEX_FILE).exists() and len(list(repo.glob("model-*.safetensors"))) >= 2
    g = torch.Generator().manual_seed(3)
    mistral_names = {"layers.0.attention.wq.weight": torch.randn(64, 64, generator=g)}
    save_file(mistral_names, str(repo / "consolidated.safetensors"))
    (repo / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2}))
    return repo


def _bundle_tensors(path: Path) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(path.rglob("*.safetensors")):
        got.update({f"{f.relative_to(path)}:{k}": v for k, v in load_file(str(f)).items()})
    return got


def _modules(path: Path) -> list[str]:
    return sorted(json.loads((path / "manifest.json").read_text())["modules"])


@pytest.mark.parametrize("with_single", [False, True], ids=["shards+consolidated", "model.safetensors+shards"])
def test_scan_of_the_repo_id_equals_the_scan_of_its_directory_and_skips_unread_files(
    mistral_repo, tmp_path, monkeypatch, with_single
):
    if with_single:  # other values than the shards: which one was read shows in the bundle
        tensors = {}
        for f in sorted(mistral_repo.glob("model-*.safetensors")):
            tensors.update({k: v * 2 for k, v in load_file(str(f)).items()})
        save_file(tensors, str(mistral_repo / "model.safetensors"), metadata={"format": "pt"})
    fake = FakeHub(mistral_repo, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", fake.list_repo_files)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    settings = dict(r=8, tau=0.8, max_rank=32)
    local = scan(mistral_repo, tmp_path / "local", **settings)
    remote = scan("acme/mistral", tmp_path / "remote", offline=False, **settings)

    assert "consolidated.safetensors" not in fake.fetched
    for patterns, _ in fake.calls:  # never even asked for
        assert list(filter_repo_objects(["consolidated.safetensors"], allow_patterns=patterns)) == []
    weights = ["model.safetensors"] if with_single else sorted(p.name for p in mistral_repo.glob("model-*"))
    assert sorted(f for f in fake.fetched if f.endswith(".safetensors")) == weights
    assert fake.listed == 1
    assert _modules(local.path) == _modules(remote.path) and len(_modules(local.path)) > 0
    a, b = _bundle_tensors(local.path), _bundle_tensors(remote.path)
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key

    fake.calls.clear()  # offline rerun: the cache as downloaded is complete (no shards needed beside model.safetensors)
    again = scan("acme/mistral", tmp_path / "again", offline=True, **settings)
    assert all(local_only for _, local_only in fake.calls) and fake.listed == 1
    c = _bundle_tensors(again.path)
    assert sorted(c) == sorted(a) and all(torch.equal(a[k], c[k]) for k in a)
