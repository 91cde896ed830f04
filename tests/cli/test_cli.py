"""The command group: lazy loading (``--help`` never imports torch), a registry that matches the modules, and a
did-you-mean for a misspelt command."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from plate_inspect.cli.main import COMMANDS, LazyGroup, cli


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


SUBMODULES = ["plate_inspect.auditing", "plate_inspect.verification", "plate_inspect.reports.audit"]


@pytest.mark.parametrize("first", ["the functions", *SUBMODULES])  # reports.audit imports auditing behind the scenes
def test_exported_functions_stay_functions_whatever_is_imported_first(first):
    """``plate_inspect.audit``/``verify`` are functions; no submodule import, before or after, turns them into modules
    (they were modules named like them, and whichever was imported first won)."""
    code = f"""
import importlib, inspect, plate_inspect
if {first!r} == "the functions":
    plate_inspect.audit, plate_inspect.verify
for mod in [{first!r}, *{SUBMODULES!r}]:
    if mod.startswith("plate_inspect."):
        importlib.import_module(mod)
from plate_inspect.auditing import summarize
from plate_inspect.verification import VerifyReport
assert all(inspect.isfunction(getattr(plate_inspect, f)) for f in ["audit", "verify", "scan", "plan_budget"])
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_deprecated_peft_path_warns_and_still_works():
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from plate_inspect.peft import PlateConfig
from plate_inspect.train.peft import PlateConfig as New
assert PlateConfig is New
assert any(w.category is DeprecationWarning and "plate_inspect.train.peft" in str(w.message) for w in caught), caught
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("command", ["align", "curvature"])
def test_analysis_commands_shorten_openmp_spinning_before_torch_loads(command, monkeypatch):
    """align and curvature get GOMP_SPINCOUNT=1000 when their module loads (before torch, in a fresh process), and
    keep a value the user set."""
    code = (
        "import os, sys\n"
        "from plate_inspect.cli.main import LazyGroup\n"
        "assert 'torch' not in sys.modules\n"
        f"LazyGroup._load({command!r})\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "1000"
    chosen = subprocess.run(
        [sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "5"}, capture_output=True, text=True, check=True
    )
    assert chosen.stdout.strip() == "5"


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
    cli_main._apply_runtime_env(cli_main.SCAN_RUNTIME_ENV)  # one of them already loaded: too late, nothing set
    assert not set(cli_main.SCAN_RUNTIME_ENV) & set(os.environ)
    monkeypatch.delitem(sys.modules, loaded)
    cli_main._apply_runtime_env(cli_main.SCAN_RUNTIME_ENV)
    assert {key: os.environ[key] for key in cli_main.SCAN_RUNTIME_ENV} == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "OPENBLAS_THREAD_TIMEOUT": "20",
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    cli_main._apply_runtime_env(cli_main.SCAN_RUNTIME_ENV)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["OPENBLAS_THREAD_TIMEOUT"] == "28"


def test_misspelt_command_gets_a_did_you_mean():
    """QA: `plate-inspect scna` said only "No such command 'scna'": the top-level group loads its commands lazily,
    so click had none to suggest from. The one error line now names the closest command (taken from the CLI's own
    command list); a word close to none gets no suggestion, and a right command still runs."""
    from plate_inspect.cli.main import COMMANDS

    runner = CliRunner()
    for typo, meant in (("scna", "scan"), ("verfy", "verify"), ("audti", "audit")):
        assert meant in COMMANDS
        result = runner.invoke(cli, [typo], prog_name="plate-inspect")
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == (
            f"error: No such command '{typo}'. Did you mean '{meant}'? (see plate-inspect --help)"
        ), result.stderr
    far = runner.invoke(cli, ["xyzzy"], prog_name="plate-inspect")
    assert far.exit_code == 2 and far.stderr.strip() == "error: No such command 'xyzzy'. (see plate-inspect --help)"
    assert runner.invoke(cli, ["scan", "--help"]).exit_code == 0
