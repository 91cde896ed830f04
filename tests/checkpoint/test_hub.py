"""The real huggingface_hub download path against a stand-in hub on 127.0.0.1 (HF_ENDPOINT, HF_HOME in tmp_path).

The stand-in (tests/helpers_hub.py) implements only what ``snapshot_download`` calls and answers errors the way the
hub does; each case runs in a fresh interpreter, because huggingface_hub reads HF_ENDPOINT and HF_HOME when it is
imported.
"""

from __future__ import annotations

import json
import shlex

import pytest
from helpers_hub import COMMIT, FILES, StandInHub, endpoint_of, open_in_fresh_process


def test_download_fetches_only_safetensors_and_json_then_runs_offline(hub, tmp_path):
    home = tmp_path / "hf-home"
    (first,) = open_in_fresh_process([("org/model", None, None)], home, endpoint_of(hub))
    assert first["ok"], first
    assert first["commit"] == COMMIT and first["files"] == ["config.json", "model.safetensors"]
    assert first["sum"] == float(sum(range(12)))
    fetched = {path.rsplit("/", 1)[-1] for method, path in StandInHub.requests if "/resolve/" in path}
    assert fetched == {"config.json", "model.safetensors"}
    assert len(StandInHub.requests) < 20
    blobs = list((home / "hub" / "models--org--model" / "blobs").iterdir())
    assert sorted(b.read_bytes() for b in blobs) == sorted([FILES["config.json"], FILES["model.safetensors"]])

    endpoint = endpoint_of(hub)
    hub.shutdown()
    hub.server_close()  # the hub is gone: the second run must not need it
    n_before = len(StandInHub.requests)
    again, other, offline = open_in_fresh_process(
        [("org/model", None, None), ("org/other", None, None), ("org/other", None, True)], home, endpoint
    )
    assert again["ok"] and again["commit"] == COMMIT and again["sum"] == first["sum"]
    assert len(StandInHub.requests) == n_before
    assert other["type"] == "HubOfflineError" and "cannot be reached" in other["message"]
    assert "nor is it a local path" in other["message"]  # a mistyped local path reads as a repo id
    assert offline["type"] == "HubOfflineError" and "offline mode is on" in offline["message"]
    for result in (other, offline):
        assert (
            "hf download org/other --include '*.safetensors' '*.json' --exclude 'consolidated*' '*/*'"
            in (result["message"])
        )


def test_offline_messages_say_what_is_missing_and_what_to_download(hub, tmp_path):
    """README walk-through: with --offline (or HF_HUB_OFFLINE=1) a repo missing from the cache entirely lacked the
    "nor is it a local path" hint the unreachable-hub message has, and both said "fetch them" with no antecedent.
    Now each says what is missing and downloads "the repo" or "the missing files"; a repo cached without its
    weights says which files are missing, and no "local path" hint (it is a repo)."""
    home, endpoint = tmp_path / "hf-home", endpoint_of(hub)
    (first,) = open_in_fresh_process([("org/model", None, None)], home, endpoint)
    assert first["ok"], first
    (weights,) = (home / "hub" / "models--org--model" / "snapshots").glob("*/model.safetensors")
    weights.unlink()  # cached, but without its weights
    hub.shutdown()
    hub.server_close()
    cache = home / "hub"
    whole = (
        f"org/other: not in the local Hugging Face cache ({cache}; missing: the whole repo), nor is it a local path "
        "(for a local model, check the path), and "
    )
    fetch_repo = (
        "; download the repo on a connected machine with: hf download org/other --include '*.safetensors' '*.json' "
        "--exclude 'consolidated*' '*/*'"
    )
    flag, unreachable, partial, partial_unreachable = open_in_fresh_process(
        [("org/other", None, True), ("org/other", None, None), ("org/model", None, True), ("org/model", None, None)],
        home,
        endpoint,
    )
    (env,) = open_in_fresh_process([("org/other", None, None)], home, endpoint, extra_env={"HF_HUB_OFFLINE": "1"})
    for result in (flag, env):
        assert result["type"] == "HubOfflineError", result
        assert result["message"] == f"{whole}offline mode is on{fetch_repo}"
    assert unreachable["message"].startswith(f"{whole}the hub cannot be reached (")
    assert unreachable["message"].endswith(fetch_repo)
    assert partial["type"] == "HubOfflineError" and partial["message"] == (
        f"org/model: not fully in the local Hugging Face cache ({cache}; missing: *.safetensors) and offline mode is "
        "on; download the missing files on a connected machine with: hf download org/model --include "
        "'*.safetensors' '*.json' --exclude 'consolidated*' '*/*'"
    )
    assert partial_unreachable["message"].startswith(
        f"org/model: not fully in the local Hugging Face cache ({cache}; missing: *.safetensors) and the hub cannot "
        "be reached ("
    )
    assert partial_unreachable["message"].endswith(
        "; download the missing files on a connected machine with: "
        "hf download org/model --include '*.safetensors' '*.json' --exclude 'consolidated*' '*/*'"
    )


def test_a_name_that_is_neither_a_path_nor_a_repo_id(tmp_path, monkeypatch):
    """'owner/name'-shaped but invalid as a repo id (a space): said as such, no network involved."""
    from plate_inspect.checkpoint import Checkpoint
    from plate_inspect.errors import HubRepoNotFoundError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(HubRepoNotFoundError, match="no such local path, and not a valid hub repo id"):
        Checkpoint.open("not a/repo id")


def test_each_hub_failure_has_its_own_one_line_message(hub, tmp_path):
    home, endpoint = tmp_path / "hf-home", endpoint_of(hub)
    missing, gated, revision, private = open_in_fresh_process(
        [
            ("org/missing", None, None),
            ("org/gated", None, None),
            ("org/model", "v9", None),
            ("org/private", None, None),
        ],
        home,
        endpoint,
    )
    bad_token, forbidden = open_in_fresh_process(
        [("org/private", None, None), ("org/forbidden", None, None)], home, endpoint, token="hf_invalid"
    )
    expected = {
        "HubRepoNotFoundError": (missing, "repository not found"),
        "HubGatedRepoError": (gated, "gated"),
        "HubRevisionNotFoundError": (revision, "revision 'v9' not found"),
        "HubUnauthorizedError": (bad_token, "HTTP 401"),
    }
    for error_type, (result, needle) in expected.items():
        assert result["type"] == error_type and needle in result["message"], result
    assert private["type"] == "HubRepoNotFoundError"  # anonymous callers cannot tell private from missing
    assert forbidden["type"] == "HubUnauthorizedError" and "HTTP 403" in forbidden["message"]
    results = [missing, gated, revision, private, bad_token, forbidden]
    assert all(r["ours"] and "\n" not in r["message"] for r in results)
    assert len({r["message"].split(":", 1)[1] for r in results if r is not private}) == 5
    assert "cannot be reached" not in " ".join(r["message"] for r in results)
    assert not (home / "hub" / "models--org--gated" / "blobs").exists() or not any(
        (home / "hub" / "models--org--gated" / "blobs").iterdir()
    )


def _download_selects(command: str, files: list[str]) -> list[str]:
    """The repo files an ``hf download REPO [FILES...] [--include P...] [--exclude P...]`` command fetches, by
    huggingface_hub's own pattern matching."""
    from huggingface_hub.utils import filter_repo_objects

    args = shlex.split(command)[3:]
    named, include, exclude, current = [], [], [], None
    for a in args:
        if a in ("--include", "--exclude", "--revision"):
            current = {"--include": include, "--exclude": exclude, "--revision": []}[a]
        elif current is None:
            named.append(a)
        else:
            current.append(a)
    if named:
        return sorted(f for f in files if f in named)
    return sorted(filter_repo_objects(files, allow_patterns=include, ignore_patterns=exclude or None))


def test_download_hint_fetches_what_the_reader_opens_and_no_second_copy(tmp_path):
    """The hint was `--include '*.safetensors' '*.json'`, which in a Mistral repo also fetches
    consolidated.safetensors (a second full copy of the weights: doubles the download) and original/. Oracle: the
    reader's own rule (hub_weight_files) plus the top-level JSON files; a few known missing shards are named."""
    from plate_inspect.hub import _fetch_hint, hub_weight_files

    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    files = [
        "config.json", "params.json", "tokenizer.json", "model.safetensors.index.json", *shards,
        "consolidated.safetensors", "original/consolidated.00.pth", "original/params.json", "README.md",
    ]  # fmt: skip
    weights = hub_weight_files(files, {"a": shards[0], "b": shards[1], "c": shards[2]})
    wanted = sorted([*weights, "config.json", "params.json", "tokenizer.json", "model.safetensors.index.json"])
    hint = _fetch_hint("org/mistral", None, None)
    assert _download_selects(hint.split(" with: ")[1], files) == wanted
    single = ["config.json", "model.safetensors", "consolidated.safetensors"]
    assert _download_selects(_fetch_hint("org/m", "v1", None).split(" with: ")[1], single) == single[:2]

    snap = tmp_path / "snap"  # cached with its index and one shard: the two missing ones are named
    snap.mkdir()
    index = {"weight_map": {"a": shards[0], "b": shards[1], "c": shards[2]}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    (snap / shards[0]).write_bytes(b"")
    hint = _fetch_hint("org/mistral", "main", snap)
    assert hint.endswith(f"hf download org/mistral {shards[1]} {shards[2]} --revision main"), hint
    assert _download_selects(hint.split(" with: ")[1], files) == shards[1:]
