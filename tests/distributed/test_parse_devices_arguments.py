"""parse_devices takes 'cuda:0,cuda:1', 'all' or a list of names; anything else (a number, None, bytes, a list of
numbers) is one ConfigError naming the argument, not a TypeError ("'int' object is not iterable")."""

from __future__ import annotations

import pytest

from plate_inspect.distributed import parse_devices
from plate_inspect.errors import ConfigError


@pytest.mark.parametrize("spec", [3, None, 1.5, b"cpu", [0, 1], ["cpu", None]])
def test_a_spec_that_is_no_names_is_refused(spec):
    with pytest.raises(ConfigError, match=r"^devices \(CLI: --devices\) must be a name or a list of names, got "):
        parse_devices(spec)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu,cpu", ["cpu", "cpu"]),
        (" cpu , cpu ", ["cpu", "cpu"]),
        (["cpu"], ["cpu"]),
        (("cpu", "cpu"), ["cpu", "cpu"]),
    ],
)
def test_names_and_lists_of_names(spec, expected):
    assert parse_devices(spec) == expected


def test_an_empty_list_is_still_refused_as_empty():
    with pytest.raises(ConfigError, match=r"^--devices is empty"):
        parse_devices([])
