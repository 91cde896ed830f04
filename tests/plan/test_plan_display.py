"""A plan as a notebook shows it (one line, whatever the module count) and plan_budget's argument errors."""

from __future__ import annotations

import pytest

from plate_inspect import ConfigError, plan_budget


def test_plan_repr_is_one_short_line_with_what_was_planned(three_r_bundle):
    plan = plan_budget(three_r_bundle, "1%")
    text = repr(plan)
    spent = sum(m["params"] for m in plan.modules.values())  # independent of Plan.spent
    assert "\n" not in text and len(text) < 400, text  # the dataclass repr held every module's dict (6 kB on MiniLM)
    assert text.startswith(f"Plan({str(three_r_bundle.path.resolve())!r}, objective='minimax', budget='1%'")
    assert f"spent={spent:,}" in text and f"modules={len(three_r_bundle)}" in text
    assert f"({plan.budget.params:,} parameters)" in text and text.endswith(f"{plan.optimality['method']})")


@pytest.mark.parametrize("budget", [None, ["1%"], True])
def test_budget_that_is_no_spec_is_refused_naming_the_argument(three_r_bundle, budget):
    """None was read as the spec 'None' ("--budget 'None': not a budget")."""
    with pytest.raises(
        ConfigError, match=r"^budget must be a string such as '1%'.*, got " + repr(budget).replace("[", r"\[")
    ):
        plan_budget(three_r_bundle, budget)


def test_a_whole_float_budget_still_counts_parameters(three_r_bundle):
    assert plan_budget(three_r_bundle, 3000.0).budget.params == plan_budget(three_r_bundle, 3000).budget.params == 3000


def test_bundle_that_is_no_path_is_refused_by_its_name():
    with pytest.raises(ConfigError, match=r"^bundle must be a path \(str or os.PathLike\), got None"):
        plan_budget(None, "1%")  # type: ignore[arg-type]


def test_plan_of_no_modules_still_prints():
    """A repr must not raise: max() over no modules did."""
    from plate_inspect.plan import Budget, Plan

    plan = Plan("id", "/b", "minimax", Budget("10", "absolute", 10.0, 10), {}, {"method": "exact"})
    assert repr(plan) == "Plan('/b', objective='minimax', budget='10' (10 parameters), spent=0, modules=0, exact)"
