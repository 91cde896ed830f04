"""The CLI's one rule for empty arguments also refuses blank ones ('  ', a tab): one error line naming the value and
the option, exit 2, nothing written (`scan M --out " "` wrote a bundle into a directory named ' ';
`--target-modules " "` scanned the default targets)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import plate_inspect.testing.synthetic as synthetic
from plate_inspect.cli.main import cli


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A one-layer Llama-like checkpoint in tmp_path/model; the working directory is an empty tmp_path/work."""
    synthetic.write_llama_like(tmp_path / "model", layers=1, seed=0)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "model"


@pytest.mark.parametrize(
    "args, line",
    [
        (["scan", "{model}", "--out", " "], "a blank value (' ') after --out"),
        (["scan", "{model}", "--out=  "], "a blank value ('  ') for --out"),
        (["scan", "{model}", "-o", "\t"], "a blank value ('\\t') after -o"),
        (["scan", "  "], "a blank value ('  ') after scan"),
        (["scan", "{model}", "--target-modules", " "], "a blank value (' ') after --target-modules"),
        (["scan", "{model}", "--target-modules= "], "a blank value (' ') for --target-modules"),
        (["scan", "{model}", "--layers", " "], "a blank value (' ') after --layers"),
        (["info", " "], "a blank value (' ') after info"),
        (["experiment", "continual", "--out", " "], "a blank value (' ') after --out"),
        (["scan", "{model}", "--out", ""], "an empty value ('') after --out"),  # the rule as it was
    ],
)
def test_a_blank_argument_is_refused_in_one_line_and_nothing_is_written(model, tmp_path, args, line):
    args = [a.format(model=model) for a in args]
    result = CliRunner().invoke(cli, args, prog_name="plate-inspect", catch_exceptions=False)
    command = " ".join(args[:2] if args[0] == "experiment" else args[:1])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: {line} (an unset shell variable?); give a value, or leave it out (see plate-inspect "
        f"{command.split()[0]} --help)\n"
    )
    assert list((tmp_path / "work").iterdir()) == []


def test_a_blank_command_names_the_programs_help(model):
    result = CliRunner().invoke(cli, [" "], prog_name="plate-inspect", catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stderr == (
        "error: a blank argument (' ') (an unset shell variable?); give a value, or leave it out (see plate-inspect "
        "--help)\n"
    )


def test_values_with_spaces_inside_are_not_blank(model, tmp_path):
    """Only an all-whitespace value is refused: a path with a space in it is a path."""
    result = CliRunner().invoke(
        cli, ["scan", str(model), "--out", "my bundle", "--r", "4", "-q"], prog_name="plate-inspect"
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "work" / "my bundle" / "manifest.json").is_file()
