"""A command that an error line suggests runs as printed when pasted into a shell, also for a path with a space or
a non-ASCII letter: the experiments' `--report-only` refusals and the audit's "bundle of another model" advice
printed the path bare (`--out dïr ü/cq`: two arguments). Checked by splitting the suggestion as a shell does."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest
from helpers_cli import assert_user_error

import plate_inspect


def suggested(output: str, command: str) -> list[str]:
    """The backquoted (or parenthesised) `plate-inspect COMMAND ...` the error line suggests, split as a shell does."""
    m = re.search(r"`(plate-inspect " + command + r"[^`]*)`", output) or re.search(
        r"\((plate-inspect " + command + r" .*?--out DIR)", output
    )
    assert m, output
    return shlex.split(m.group(1))


@pytest.mark.parametrize("experiment", ["continual", "sequential"])
def test_report_only_of_an_empty_dir_suggests_a_runnable_command(tmp_path, experiment):
    out = tmp_path / "dïr ü" / "runs"
    out.mkdir(parents=True)
    output = assert_user_error(["experiment", experiment, "--out", out, "--report-only"], "here; run")
    words = suggested(output, f"experiment {experiment}")
    assert words[words.index("--out") + 1] == str(out)  # one argument, the directory itself


def test_audit_bundle_of_another_model_suggests_scanning_base_by_its_path(qwen_ckpt, gpt2_ckpt, tmp_path):
    bundle = tmp_path / "qwen bundle"
    plate_inspect.scan(qwen_ckpt.path, bundle, r=8)
    base = tmp_path / "my base"
    shutil.copytree(gpt2_ckpt.path, base)
    output = assert_user_error(["audit", base, base, "--bundle", bundle, "-q"], "made for another model")
    words = suggested(output, "scan")
    assert words[2] == str(base)
