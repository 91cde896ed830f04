"""Session 18's rough edges: the default scan --out of a symlinked or relative path, the warnings of the PEFT path
against LoRA's, and reentrant checkpointing after ``apply_bundle`` (no PeftModel)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import plate_inspect.testing.synthetic as synthetic
from plate_inspect.cli.main import cli
from plate_inspect.scanner import default_out_dir

# --------------------------------------------------------------------------- 1. the default --out


@pytest.fixture
def linked(tmp_path, monkeypatch):
    """tmp_path holding a/real/model.safetensors (a real file), b/model.safetensors and b/mine.safetensors (links
    to it), linkdir (a link to a/real) and an HF hub cache snapshot whose model.safetensors links to a blob; the
    working directory is tmp_path, and $PWD says so."""
    (tmp_path / "a" / "real").mkdir(parents=True)
    (tmp_path / "a" / "real" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").symlink_to("../a/real/model.safetensors")
    (tmp_path / "b" / "mine.safetensors").symlink_to("../a/real/model.safetensors")
    (tmp_path / "linkdir").symlink_to("a/real")
    repo = tmp_path / "hub" / "models--Org--Tiny-1B"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "9f86d081884c7d65").write_bytes(b"x")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "model.safetensors").symlink_to("../../blobs/9f86d081884c7d65")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "given, name",
    [
        ("b/model.safetensors", "b"),  # was bundles/real: the link's target directory
        ("./b/model.safetensors", "b"),
        ("b/mine.safetensors", "mine"),  # the stem as given (was bundles/real: the target's stem is model)
        ("linkdir", "linkdir"),  # was bundles/real
        ("linkdir/", "linkdir"),
        ("linkdir/model.safetensors", "linkdir"),
        ("a/real", "real"),
        ("a/real/model.safetensors", "real"),
        ("b/..", None),  # the working directory's name
        ("hub/models--Org--Tiny-1B/snapshots/0123abcd", "Tiny-1B"),
        ("hub/models--Org--Tiny-1B/snapshots/0123abcd/model.safetensors", "Tiny-1B"),  # was the blob's hash
        ("Org/Some-Model", "Some-Model"),  # a hub repo id
    ],
)
def test_default_out_is_named_after_the_path_as_given(linked, given, name):
    assert default_out_dir(given) == Path("bundles") / (name or linked.name)
    assert default_out_dir(linked / given) == Path("bundles") / (name or linked.name)  # absolute: the same


def test_default_out_of_dot_is_the_working_directory_as_the_shell_names_it(linked, monkeypatch):
    """`cd linkdir && plate-inspect scan .`: bundles/linkdir, the name the shell shows ($PWD), not the link's
    target; a stale $PWD (a chdir since, as in a script) falls back to the resolved directory."""
    monkeypatch.chdir(linked / "b")
    monkeypatch.setenv("PWD", str(linked / "b"))
    assert default_out_dir(".") == default_out_dir("./model.safetensors") == Path("bundles") / "b"
    monkeypatch.chdir(linked / "linkdir")
    monkeypatch.setenv("PWD", str(linked / "linkdir"))
    assert default_out_dir(".") == default_out_dir("./model.safetensors") == Path("bundles") / "linkdir"
    monkeypatch.setenv("PWD", str(linked / "b"))  # names another directory: not trusted
    assert default_out_dir(".") == Path("bundles") / "real"
    monkeypatch.delenv("PWD")
    assert default_out_dir(".") == Path("bundles") / "real"


def test_cli_scan_of_a_linked_file_names_the_bundle_as_given_and_records_the_weights(tmp_path, monkeypatch):
    """scan b/model.safetensors (a link into a/real) writes bundles/b; the manifest records the resolved file,
    so a scan of the same weights by their own path into that bundle counts as the same model (no note)."""
    synthetic.write_llama_like(tmp_path / "a" / "real", layers=1, seed=0)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").symlink_to("../a/real/model.safetensors")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["scan", "b/model.safetensors", "--r", "4", "-q"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["b"]
    assert "-> bundles/b" in res.output
    source = json.loads((tmp_path / "bundles" / "b" / "manifest.json").read_text())["source"]
    assert source["id"] == os.path.realpath(tmp_path / "a" / "real" / "model.safetensors")
    again = CliRunner().invoke(cli, ["scan", "a/real", "--out", "bundles/b", "--r", "4", "-q"])
    assert again.exit_code == 0 and "holds a bundle of" not in again.output, again.output
