"""One spelling per option across the commands: an option that several commands take is a flag in all of them or a
value in all of them, ``--out`` always has ``-o`` and ``--quiet`` always ``-q``, and every option says what it is for.
Read from the click commands themselves, so a new command is checked without a list here."""

from __future__ import annotations

from collections import defaultdict

import click
import pytest
from helpers_cli import assert_user_error

from plate_inspect.cli.main import COMMANDS, cli

#: The one option name whose meaning differs by command, on purpose: scan's --report is a flag (the report goes into
#: the bundle, <out>/report.html); audit has no directory of its own, so its --report takes the page's path.
DIFFERENT_BY_DESIGN = {"--report"}


def leaf_commands() -> dict[str, click.Command]:
    """Every runnable command by its command line ('experiment continual'), groups walked."""
    ctx = click.Context(cli)
    found: dict[str, click.Command] = {}

    def walk(cmd: click.Command, path: str) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, name
                walk(sub, f"{path} {name}".strip())
        else:
            found[path] = cmd

    walk(cli, "")
    return found


def options_by_name() -> dict[str, list[tuple[str, click.Option]]]:
    uses: dict[str, list[tuple[str, click.Option]]] = defaultdict(list)
    for path, cmd in leaf_commands().items():
        for param in cmd.params:
            if isinstance(param, click.Option):
                long = [o for o in param.opts if o.startswith("--")][0]
                uses[long].append((path, param))
    return uses


def test_every_command_is_walked():
    assert {p.split()[0] for p in leaf_commands()} == set(COMMANDS)


def test_an_out_option_always_has_its_short_form():
    outs = options_by_name()["--out"]
    assert len(outs) >= 7  # scan, report, plan, merge, curvature, both experiments
    assert [path for path, opt in outs if "-o" not in opt.opts] == []


def test_a_quiet_option_always_has_its_short_form():
    quiets = options_by_name()["--quiet"]
    assert [path for path, opt in quiets if "-q" not in opt.opts] == []


def test_a_shared_option_is_a_flag_everywhere_or_a_value_everywhere():
    mixed = {
        name: sorted(f"{path}: {'flag' if opt.is_flag else 'value'}" for path, opt in uses)
        for name, uses in options_by_name().items()
        if len({opt.is_flag for _, opt in uses}) > 1 and name not in DIFFERENT_BY_DESIGN
    }
    assert mixed == {}


def test_every_option_has_help():
    silent = [
        f"{path} {name}"
        for name, uses in options_by_name().items()
        for path, opt in uses
        if not opt.help and not isinstance(opt.type, click.Choice)  # a choice's values say what it is
    ]
    assert silent == []


@pytest.mark.parametrize("flag", ["-o", "--out"])
def test_curvature_out_short_and_long_forms_are_one_option(tmp_path, flag):
    """Checked before the stage-1 training, so this costs no run: a file in the way of the output directory."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    assert_user_error(["curvature", flag, blocker, "-q"], "cannot create the output directory", "choose another --out")
    assert blocker.read_text() == "mine"


def test_every_command_that_draws_a_progress_bar_can_be_quieted():
    """A long command draws a rich bar on stderr; in a script or a log it is noise, and -q must turn it off."""
    import inspect

    drawing = [path for path, cmd in leaf_commands().items() if "progress_bar(" in inspect.getsource(cmd.callback)]
    assert "scan" in drawing and "verify" in drawing  # found by reading the commands, not listed here
    lacking = [path for path in drawing if "--quiet" not in options_by_name_of(leaf_commands()[path])]
    assert lacking == []


def options_by_name_of(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
