"""Packaging: the wheel holds every module of the repository under ``plate_inspect`` and nothing at the top level.

``cli/`` and ``reports/`` live at the repository's top level but install as ``plate_inspect.cli`` and
``plate_inspect.reports`` (pyproject's ``package-dir``). The package list there is written by hand, so a new
subpackage that is not added to it would be missing from every installed copy while the editable install used by
the tests still finds it. Oracle: the repository's own files, compared with the wheel built from them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Repository directory -> the import package it installs as.
INSTALLED_AS = {"plate_inspect": "plate_inspect", "cli": "plate_inspect/cli", "reports": "plate_inspect/reports"}


def _expected_files() -> set[str]:
    """Every module and marker file of the repository, under the path it must have in the wheel."""
    expected = set()
    for source, installed in INSTALLED_AS.items():
        for path in (ROOT / source).rglob("*"):
            if path.suffix in {".py", ".typed"} and "__pycache__" not in path.parts:
                expected.add(f"{installed}/{path.relative_to(ROOT / source).as_posix()}")
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the repository (so the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", *INSTALLED_AS):
        item = ROOT / name
        if item.is_dir():
            shutil.copytree(item, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(item, src / name)
    out = tmp_path_factory.mktemp("dist")
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_wheel_holds_every_module_under_plate_inspect(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    expected = _expected_files()
    assert expected - modules == set(), "missing from the wheel: add the subpackage to pyproject's packages"
    assert {n.split("/")[0] for n in modules} == {"plate_inspect"}, "the wheel installs a top-level name"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "plate-inspect = plate_inspect.cli.main:main" in text


def test_installed_wheel_imports_without_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """Unpacked on its own (the checkout off sys.path), the CLI and reports import from the wheel's files, and
    neither ``cli`` nor ``reports`` is importable as a top-level module."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import importlib.util, plate_inspect, plate_inspect.cli.main, plate_inspect.reports.html;"
        "print(plate_inspect.__file__);"
        "print(plate_inspect.cli.main.__file__);"
        "print(importlib.util.find_spec('cli'), importlib.util.find_spec('reports'))"
    )
    # -I: isolated (no PYTHONPATH, no user site, no script directory); the venv's site-packages stay on the path
    # for torch and friends, but the editable install's finder would win over them, so the probe puts the
    # unpacked wheel first.
    code = f"import sys; sys.path.insert(0, {str(site)!r}); exec({probe!r})"
    done = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    package_file, cli_file, specs = done.stdout.strip().splitlines()[-3:]
    assert package_file.startswith(str(site)) and cli_file.startswith(str(site))
    assert specs == "None None"
