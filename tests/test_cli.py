"""The command group: lazy loading (``--help`` never imports torch) and a registry that matches the modules."""

from __future__ import annotations

import subprocess
import sys

import click

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
