"""parse_devices takes 'cuda:0,cuda:1', 'all' or a list of names; anything else (a number, None, bytes, a list of
numbers) is one ConfigError naming the argument, not a TypeError ("'int' object is not iterable")."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cuda:1,cuda:0", ["cuda:1", "cuda:0"]),
        ("cuda:01, cpu", ["cuda:1", "cpu"]),  # torch refused 'cuda:01' with a traceback (Invalid device string)
        ([" cuda:0", "cuda:1 "], ["cuda:0", "cuda:1"]),  # a list's names are stripped as the string's are
    ],
)
def test_gpu_names_come_back_as_torch_names_them(spec, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_devices(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cuda:0,cuda:00", r"^--devices names a GPU twice \(cuda:0, cuda:00\); give each GPU once$"),  # was 2 workers
        ("cuda:1,cuda:2", r"^--devices: cuda:2 is not visible \(this machine shows 2 GPUs\)$"),
        ("cuda:\u0663", r"^--devices: 'cuda:\u0663' is not cpu or cuda:N$"),  # a digit to str.isdigit, not to torch
        ("cuda:-1", r"^--devices: 'cuda:-1' is not cpu or cuda:N$"),
    ],
)
def test_a_gpu_named_twice_or_not_there_is_one_line(spec, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=message):
        parse_devices(spec)
