"""Inputs the public annotations allow that crashed: found by type-checking the package with mypy."""

from __future__ import annotations

import math
from fractions import Fraction

import helpers_train
import pytest

from plate_inspect.arguments import finite_numbers, non_negative_number, positive_number, real_value
from plate_inspect.errors import ConfigError
from plate_inspect.experiments.continual import ContinualSettings
from plate_inspect.experiments.methods import Budget, check_budget
from plate_inspect.geometry import validate_settings
from plate_inspect.plan import Allocation
from plate_inspect.train.core import check_rho
from plate_inspect.train.layer import apply_bundle
from plate_inspect.train.peft import PlateConfig


@pytest.mark.parametrize("rho", [10**400, -(10**400), Fraction(10**400, 3)], ids=["1e400", "-1e400", "fraction"])
def test_rho_beyond_float_range_is_a_config_error(rho):
    """An int or Fraction too large for a float was an OverflowError traceback ('int too large to convert to
    float') instead of the rule every other non-finite rho gets."""
    with pytest.raises(ConfigError, match="rho must be a positive finite number"):
        check_rho(rho)


def test_rho_beyond_float_range_is_refused_by_the_entry_points(tmp_path):
    _, ckpt, bundle = helpers_train.digits_setup(tmp_path)
    with pytest.raises(ConfigError, match="rho must be a positive finite number"):
        apply_bundle(helpers_train.load_digits(ckpt), bundle, rho=10**400)
    with pytest.raises(ConfigError, match="rho must be a positive finite number"):
        PlateConfig(bundle=str(bundle.path), rho=10**400)
    # the ordinary values are unchanged: ints and Fractions become floats
    assert check_rho(2) == 2.0
    assert check_rho(Fraction(1, 4)) == 0.25


def test_greedy_allocation_without_a_lower_bound_has_no_gap():
    """``lower_bound`` is ``float | None``; a greedy Allocation without one raised TypeError in to_json
    (float - None)."""
    assert Allocation([1, 2], "greedy", 0.25, "too many states").to_json() == {
        "method": "greedy",
        "objective": 0.25,
        "reason": "too many states",
        "lower_bound": None,
        "gap": None,
    }
    with_bound = Allocation([1, 2], "greedy", 0.25, "too many states", lower_bound=0.125).to_json()
    assert with_bound["gap"] == 0.125  # 0.25 - 0.125, exact in binary


def test_continual_lr_beyond_float_range_is_a_config_error():
    """ContinualSettings.validate: lr=10**400 was an OverflowError traceback, like rho."""
    with pytest.raises(ConfigError, match="lr must be a positive finite number"):
        ContinualSettings(lr=10**400).validate()
    ContinualSettings(lr=Fraction(1, 1000)).validate()  # an ordinary Real still passes


BEYOND_FLOAT = [10**400, -(10**400), Fraction(10**400, 3)]


@pytest.mark.parametrize("value", BEYOND_FLOAT)
@pytest.mark.parametrize(
    "check",
    [
        lambda v: validate_settings(r=4, tau=v, max_rank=8),
        lambda v: non_negative_number(v, "beta"),
        lambda v: positive_number(v, "lr"),
        lambda v: finite_numbers([0.5, v], "rhos"),
        lambda v: check_budget("l2_init", Budget("big", {"lam": v})),
        lambda v: check_budget("plate", Budget("big", {"r": 8, "tau": v})),
    ],
    ids=["tau", "non_negative_number", "positive_number", "finite_numbers", "budget_lam", "budget_tau"],
)
def test_numbers_beyond_float_range_are_a_config_error_in_every_number_check(check, value):
    """``float(10**400)`` raises OverflowError; every number check reads such a value as not finite (one rule,
    arguments.real_value) and says so in one line, the value cut to 80 characters."""
    with pytest.raises(ConfigError) as caught:
        check(value)
    assert len(str(caught.value)) < 200


def test_real_value_keeps_ordinary_numbers_and_marks_the_rest():
    assert real_value(Fraction(1, 2)) == 0.5 and real_value(3) == 3.0
    assert real_value(10**400) == math.inf and real_value(-(10**400)) == -math.inf
    assert all(math.isnan(real_value(v)) for v in (True, "0.5", None, [1]))
