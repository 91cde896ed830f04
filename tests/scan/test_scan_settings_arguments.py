"""ScanSettings and the scan's own arguments refuse values of the wrong kind in one ConfigError naming them (they
were read by truth value, or failed inside torch/`<` with a TypeError)."""

from __future__ import annotations

import pytest

from plate_inspect.bundle import ScanSettings
from plate_inspect.errors import ConfigError
from plate_inspect.scanner import plan_scan, run_scan
from plate_inspect.testing.synthetic import write_llama_like


@pytest.mark.parametrize("value", ["no", "yes", 2, None, 0.5])
def test_include_mtp_is_true_or_false(value):
    with pytest.raises(ConfigError, match="include_mtp must be True or False"):
        ScanSettings(include_mtp=value)


@pytest.mark.parametrize("value", [True, False, 1, 0])
def test_include_mtp_takes_bools_and_their_integers(value):
    assert ScanSettings(include_mtp=value).include_mtp is bool(value)


@pytest.mark.parametrize("value", [None, "0.9", [0.5, float("nan")], 3])
def test_tau_grid_must_be_finite_numbers(value):
    with pytest.raises(ConfigError, match="tau_grid must be a list of finite numbers"):
        ScanSettings(tau_grid=value)


def test_an_empty_tau_grid_is_the_tau_alone():
    assert ScanSettings(tau_grid=[]).tau_grid == ()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_like(tmp_path_factory.mktemp("m") / "model", layers=1).path


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(expert_group="x"), "expert_group must be a positive integer"),
        (dict(expert_group=2.5), "expert_group must be a positive integer"),
        (dict(expert_group=0), "expert_group must be a positive integer"),
        (dict(device=None), "device must be cpu, cuda or cuda:N"),
        (dict(device=3), "device must be cpu, cuda or cuda:N"),
    ],
)
def test_scan_device_and_expert_group_are_config_errors(model, tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        run_scan(plan_scan(model, ScanSettings(r=4)), tmp_path / "b", **kwargs)
    assert not (tmp_path / "b").exists()
