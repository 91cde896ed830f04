"""The command group: lazy loading (``--help`` never imports torch) and a registry that matches the modules."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest

from plate_inspect.cli.main import COMMANDS, LazyGroup


def test_help_lists_every_command_without_importing_torch():
    code = (
        "import sys\n"
        "from plate_inspect.cli.main import cli\n"
        "try:\n"
        "    cli(['--help'], prog_name='plate-inspect')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("NO-TORCH"), out
    for name in COMMANDS:
        assert f"  {name} " in out, name


def test_every_registered_command_loads_as_a_click_command():
    for name in COMMANDS:
        command = LazyGroup._load(name)
        assert isinstance(command, click.Command), name


def test_import_plate_inspect_is_lazy_but_complete():
    code = "import sys, plate_inspect; assert 'torch' not in sys.modules; print(plate_inspect.Bundle.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "Bundle"


@pytest.mark.parametrize("loaded", ["torch", "numpy", "scipy"])
def test_scan_command_sets_its_runtime_env_before_its_libraries_load(monkeypatch, loaded):
    """`plate-inspect scan` asks libgomp for passive waiting, OpenBLAS for short spinning and torch for huge pages,
    unless torch, NumPy or SciPy is already loaded (each reads its variables at load: too late) or the user chose a
    value."""
    from plate_inspect.cli import main as cli_main

    assert set(cli_main.SCAN_RUNTIME_ENV) == {"OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT", "THP_MEM_ALLOC_ENABLE"}
    for key in cli_main.SCAN_RUNTIME_ENV:
        monkeypatch.delenv(key, raising=False)
    for name in ("torch", "numpy", "scipy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, loaded, object())
    cli_main._scan_runtime_env()  # one of them already loaded: too late, nothing set
    assert not set(cli_main.SCAN_RUNTIME_ENV) & set(os.environ)
    monkeypatch.delitem(sys.modules, loaded)
    cli_main._scan_runtime_env()
    assert {key: os.environ[key] for key in cli_main.SCAN_RUNTIME_ENV} == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "OPENBLAS_THREAD_TIMEOUT": "20",
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    cli_main._scan_runtime_env()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["OPENBLAS_THREAD_TIMEOUT"] == "28"
