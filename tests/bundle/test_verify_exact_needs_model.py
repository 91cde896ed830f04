"""verify --exact without MODEL: one check, verify()'s, for the Python API and the CLI alike (the CLI had its own
copy of it, worded apart)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from plate_inspect import scan, verify
from plate_inspect.cli.main import cli
from plate_inspect.errors import ConfigError
from plate_inspect.testing.synthetic import write_llama_like

API_LINE = "exact=True (CLI: --exact) needs source (CLI: MODEL): the oracle is computed from the model's weights"
CLI_LINE = "error: --exact needs MODEL: the oracle is computed from the model's weights\n"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return scan(write_llama_like(root / "model", layers=1).path, root / "bundle", r=4, tau=0.9, max_rank=64)


def test_the_api_and_the_cli_say_the_same_line(bundle):
    with pytest.raises(ConfigError) as e:
        verify(bundle.path, exact=True)
    assert str(e.value) == API_LINE
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(
            cli, ["verify", str(bundle.path), "--exact", *extra], prog_name="plate-inspect", catch_exceptions=False
        )
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", CLI_LINE)


def test_cli_text_shows_an_arguments_cli_name():
    from plate_inspect.errors import cli_text

    assert cli_text("exact=True (CLI: --exact) needs source (CLI: MODEL): x") == "--exact needs MODEL: x"
    assert cli_text("bundle (CLI: BUNDLE) and out (CLI: --out)") == "BUNDLE and out (--out)"
    assert cli_text("a note (CLI: lower) stays") == "a note (CLI: lower) stays"  # only an argument's NAME


def test_the_cli_has_no_check_of_its_own(monkeypatch, bundle):
    """The CLI passes --exact on and lets verify() judge it: a verify that accepts it runs."""
    import plate_inspect.verification as verification

    seen = {}

    def fake_verify(bundle, source=None, **kwargs):
        seen.update(source=source, **kwargs)
        raise ConfigError("judged by verify")

    monkeypatch.setattr(verification, "verify", fake_verify)
    result = CliRunner().invoke(cli, ["verify", str(bundle.path), "--exact"], prog_name="plate-inspect")
    assert result.exit_code == 2 and result.stderr == "error: judged by verify\n"
    assert seen["source"] is None and seen["exact"] is True
