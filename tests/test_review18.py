"""Session 18 review: the public API of the core library checks its arguments at the boundary (a ConfigError naming
the argument, not a TypeError/AttributeError from deep inside), and audit takes its settings as scan does."""

from __future__ import annotations

import pytest

import plate_inspect
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.errors import ConfigError
from plate_inspect.testing.synthetic import write_gpt2


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A small GPT-2 checkpoint and its bundle (r=4)."""
    root = tmp_path_factory.mktemp("review18")
    model = write_gpt2(root / "model").path
    plate_inspect.scan(str(model), out=str(root / "bundle"), r=4, tau=0.9)
    return model, plate_inspect.Bundle.load(root / "bundle")


@pytest.mark.parametrize("source", [None, 3, ""])
def test_checkpoint_open_names_a_bad_source(source):
    """None and 3 raised a TypeError from Path; '' opened the working directory."""
    with pytest.raises(ConfigError, match=r"^source must be a path"):
        Checkpoint.open(source)


def test_checkpoint_open_names_a_bad_revision():
    with pytest.raises(ConfigError, match=r"^revision must be a branch, tag or commit"):
        Checkpoint.open("org/name", revision=3, offline=True)
