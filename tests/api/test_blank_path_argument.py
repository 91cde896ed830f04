"""A blank path given to the Python API is refused as the CLI refuses a blank argument: '  ' named a directory of
spaces (an unset variable with a stray space), never what the caller meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from plate_inspect.atomic import path_argument
from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits


@pytest.mark.parametrize("blank", ["", " ", "  ", "\t", " \n"])
def test_blank_path_is_refused(blank):
    with pytest.raises(ConfigError, match=r"^out must be a path \(str or os.PathLike\), got "):
        path_argument(blank, "out")


def test_a_path_with_spaces_inside_is_kept():
    assert path_argument(" a b ", "out") == Path(" a b ")


def test_blank_save_path_writes_nothing(tmp_path, monkeypatch):
    """A public writer that takes a path: nothing appears in the current directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^path must be a path"):
        digits.save_model(digits.DigitsMLP(d_in=4, hidden=4, n_classes=2), "  ")
    assert list(tmp_path.iterdir()) == []
