"""The default scan --out of ``..`` and ``.`` in a working directory reached through a symlink: named as the shell
names the directory (``$PWD``, links not followed), while the manifest records the resolved weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import plate_inspect.testing.synthetic as synthetic
from plate_inspect.cli.main import cli
from plate_inspect.scanner import default_out_dir


@pytest.fixture
def in_linked_sub(tmp_path, monkeypatch):
    """tmp_path/real holds a model and a subdirectory sub; tmp_path/link -> real. The working directory is
    link/sub as `cd link/sub` leaves it: the process's own (getcwd) is real/sub, $PWD says link/sub."""
    synthetic.write_llama_like(tmp_path / "real", layers=1, seed=0)
    (tmp_path / "real" / "sub").mkdir()
    (tmp_path / "link").symlink_to("real")
    monkeypatch.chdir(tmp_path / "link" / "sub")
    monkeypatch.setenv("PWD", str(tmp_path / "link" / "sub"))
    assert Path.cwd() == (tmp_path / "real" / "sub").resolve()  # the kernel's view: the link is resolved
    return tmp_path


def test_dot_dot_is_the_logical_parent(in_linked_sub):
    """`..` in link/sub is link (as `cd ..` goes and the prompt shows), not real (the link's target)."""
    assert default_out_dir("..") == Path("bundles") / "link"
    assert default_out_dir("../") == Path("bundles") / "link"
    assert default_out_dir("../model.safetensors") == Path("bundles") / "link"
    assert default_out_dir(".") == Path("bundles") / "sub"
    assert default_out_dir("../sub/..") == Path("bundles") / "link"


def test_a_stale_pwd_falls_back_to_the_resolved_directory(in_linked_sub, monkeypatch):
    """$PWD naming another directory (a chdir since, as in a script) is not trusted: the resolved parent."""
    monkeypatch.setenv("PWD", str(in_linked_sub))
    assert default_out_dir("..") == Path("bundles") / "real"
    monkeypatch.delenv("PWD")
    assert default_out_dir("..") == Path("bundles") / "real"


def test_dot_dot_through_a_link_in_the_path_is_read_as_typed(tmp_path, monkeypatch):
    """`link/..` is the directory holding link, as `cd link/..` goes (the kernel's link/.. is real's parent, which
    is the same directory here, so a second level shows the difference)."""
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "link").symlink_to("../a/deep")
    monkeypatch.chdir(tmp_path / "b")
    monkeypatch.setenv("PWD", str(tmp_path / "b"))
    assert (tmp_path / "b" / "link" / "..").resolve() == tmp_path / "a"  # what following the link gives
    assert default_out_dir("link/..") == Path("bundles") / "b"


def test_cli_scan_of_dot_dot_writes_bundles_link_and_records_the_resolved_weights(in_linked_sub):
    result = CliRunner().invoke(cli, ["scan", "..", "--r", "4", "-q"], prog_name="plate-inspect")
    assert result.exit_code == 0, result.output
    assert "-> bundles/link" in result.output
    here = in_linked_sub / "real" / "sub"
    assert sorted(p.name for p in (here / "bundles").iterdir()) == ["link"]
    source = json.loads((here / "bundles" / "link" / "manifest.json").read_text())["source"]
    assert source["id"] == os.path.realpath(in_linked_sub / "real")
