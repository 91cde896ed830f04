"""The command line run in-process, for tests in several directories."""

from __future__ import annotations

from click.testing import CliRunner

from plate_inspect.cli.main import cli


def run_cli(*args: object) -> tuple[int, str]:
    """Run ``plate-inspect ARGS`` (each argument str()-ed) with exceptions propagated: (exit code, output)."""
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output
