"""The command line run in-process, for tests in several directories: its output, the one-line user error every
mistake must give, and a small tmpfs to fill (a full disk, a read-only directory)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from click.testing import CliRunner

from plate_inspect.cli.main import cli


def run_cli(*args: object) -> tuple[int, str]:
    """Run ``plate-inspect ARGS`` (each argument str()-ed) with exceptions propagated: (exit code, output)."""
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def assert_user_error(args, *needles):
    """``plate-inspect ARGS`` exits 2 with exactly one ``error:`` line, no traceback, and every needle after it;
    returns the output from ``error:`` on."""
    code, output = run_cli(*args)
    assert code == 2, output
    assert "Traceback" not in output
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, output
    output = output[output.index("error:") :]
    for needle in needles:
        assert needle in output, (needle, output)
    return output


def mount_tmpfs(path: Path, options: str) -> bool:
    """Mount a small tmpfs at ``path`` (root with mount permission only); False where this machine cannot."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0
