"""Python API arguments of the wrong kind: one ConfigError naming the argument and what it takes, raised before any
work (not an AttributeError from ``str.split``, not a TypeError from deep inside run_scan after a merge was written)."""

from __future__ import annotations

import pytest
from helpers_train import load_digits

import plate_inspect.train.sequential as sequential
from plate_inspect.arguments import text_argument
from plate_inspect.errors import ConfigError
from plate_inspect.experiments.methods import parse_methods
from plate_inspect.train.layer import apply_bundle


@pytest.mark.parametrize("value", [3, None, ["lora", "plate"], b"lora"])
def test_parse_methods_refuses_a_value_that_is_not_a_string(value):
    with pytest.raises(ConfigError) as e:
        parse_methods(value)
    assert str(e.value) == (f"methods (CLI: --methods) must be a string such as 'full_ft,l2_init', got {value!r}")


def test_text_argument_passes_strings_through_and_names_the_argument():
    assert text_argument("0-3,7", "layers", "0-3,7") == "0-3,7"
    assert text_argument("", "layers", "0-3,7") == ""  # empty text is the parser's to judge (it names the option)
    with pytest.raises(ConfigError, match=r"^layers must be a string such as '0-3,7', got \[0, 3\]$"):
        text_argument([0, 3], "layers", "0-3,7")


def test_scan_overrides_are_split_into_settings_and_run_scan_keywords():
    fields, run = sequential.split_scan_overrides(
        {"tau": 0.8, "r": 8, "device": "cpu", "overwrite": True, "expert_group": 2}
    )
    assert fields == {"tau": 0.8, "r": 8}
    assert run == {"device": "cpu", "overwrite": True, "expert_group": 2}
    with pytest.raises(ConfigError) as e:
        sequential.split_scan_overrides({"tua": 0.5, "bogus": 1, "r": 8})
    message = str(e.value)
    assert message.startswith("unknown scan settings 'tua', 'bogus' (did you mean 'tau'?); the rescan takes ")
    for allowed in ("r,", "tau,", "max_rank", "include_mtp", "overwrite", "device,", "devices", "progress"):
        assert allowed in message, allowed


def test_rescan_refuses_an_unknown_keyword_before_scanning(digits_adapter, tmp_path):
    ckpt, bundle, _ = digits_adapter
    with pytest.raises(ConfigError, match=r"^unknown scan setting 'bogus'; the rescan takes ScanSettings fields"):
        sequential.rescan(ckpt, bundle, tmp_path / "re", bogus=1)
    with pytest.raises(ConfigError, match=r"unknown scan setting 'tua' \(did you mean 'tau'\?\)"):
        sequential.rescan(ckpt, bundle.path, tmp_path / "re", tua=0.5)
    assert not (tmp_path / "re").exists()
    again = sequential.rescan(ckpt, bundle, tmp_path / "re", tau=0.7)  # a real setting still overrides the bundle's
    assert again.settings.tau == 0.7 and again.settings.r == bundle.settings.r


def test_sequential_step_refuses_an_unknown_keyword_before_merging(digits_adapter, tmp_path):
    """The merged checkpoint was written, then run_scan failed with a TypeError: now nothing is written."""
    ckpt, _, adapter = digits_adapter
    with pytest.raises(ConfigError, match=r"^unknown scan setting 'bogus'; "):
        sequential.sequential_step(ckpt, adapter, tmp_path / "merged", bogus=1)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("method", [3, None, ["lora"], "lora2"])
def test_a_method_that_is_not_a_known_name_is_one_config_error(method):
    """default_budgets(3) was an AttributeError from str.startswith; every entry point says the same line."""
    from plate_inspect.experiments import methods

    line = f"unknown method {method!r}; choose from {', '.join(methods.METHODS)}"
    for call in (
        lambda: methods.default_budgets(method),
        lambda: methods.budget_keys(method),
        lambda: methods.check_budget(method, methods.Budget("r8", {"rank": 8})),
        lambda: methods.prepare(method, {}, None),  # refused before the stage-1 model is read
    ):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value) == line


def test_every_known_method_still_has_budgets_that_pass_its_check():
    from plate_inspect.experiments import methods

    for method in methods.METHODS:
        budgets = methods.default_budgets(method)
        assert budgets and all(set(b.config) == set(methods.budget_keys(method)) for b in budgets)
        for b in budgets:
            methods.check_budget(method, b)


@pytest.mark.parametrize(
    "r, tau, line",
    [
        (8, None, "plate_budget: tau must be a number strictly between 0 and 1, got None"),
        (8, 1.0, "plate_budget: tau must be a number strictly between 0 and 1, got 1.0"),
        (0, 0.9, "plate_budget: r must be an integer >= 1, got 0"),
        (8.5, 0.9, "plate_budget: r must be an integer >= 1, got 8.5"),
    ],
)
def test_plate_budget_checks_its_values(r, tau, line):
    from plate_inspect.experiments.methods import Budget, plate_budget

    with pytest.raises(ConfigError) as e:
        plate_budget(r, tau)
    assert str(e.value) == line
    assert plate_budget(32, 0.9) == Budget("r32_tau0.9", {"r": 32, "tau": 0.9})


def test_unload_refuses_a_merge_flag_that_is_not_a_bool(digits_adapter):
    """unload(model, merge="no") merged (the string is truthy)."""
    from plate_inspect.train.layer import plate_layers, unload

    ckpt, bundle, _ = digits_adapter
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    for value in ("no", 0, None):
        with pytest.raises(ConfigError, match=rf"^merge must be True or False, got {value!r}$"):
            unload(model, merge=value)
    assert sorted(plate_layers(model)) == ["fc1", "fc2", "fc3"]  # untouched


def test_check_rescan_out_names_its_argument(tmp_path):
    with pytest.raises(ConfigError, match=r"^bundle_out \(CLI: --rescan\) must be a path .*got None$"):
        sequential.check_rescan_out(None)
    with pytest.raises(ConfigError, match=r"^overwrite must be True or False, got 'no'$"):
        sequential.check_rescan_out(tmp_path / "b", overwrite="no")
    assert sequential.check_rescan_out(tmp_path / "b") == tmp_path / "b"


def test_positive_number_and_bool_argument():
    from plate_inspect.arguments import bool_argument, positive_number

    assert positive_number(1e-3, "lr") == 1e-3 and positive_number(2, "lr") == 2.0
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1e-3", None):
        with pytest.raises(ConfigError, match=rf"^lr must be a positive finite number, got {bad!r}$"):
            positive_number(bad, "lr")
    assert bool_argument(False, "merge") is False
    for bad in ("no", 0, 1, None):
        with pytest.raises(ConfigError, match=rf"^merge must be True or False, got {bad!r}$"):
            bool_argument(bad, "merge")


@pytest.mark.parametrize("seeds", [b"x", bytearray(b"\x01"), "5"])
def test_seeds_given_as_bytes_or_text_are_refused_not_read_as_numbers(seeds, tmp_path):
    """``b'x'`` iterated as the seed 120 and the whole experiment ran with it; now one ConfigError, before any
    training, in the continual and the sequential experiment alike (one rule, continual.seed_list)."""
    from plate_inspect.experiments.continual import seed_list
    from plate_inspect.experiments.sequential_tasks import run_sequential

    with pytest.raises(ConfigError, match="seeds must be a count or a list of integers"):
        seed_list(seeds)
    with pytest.raises(ConfigError, match="seeds must be a count or a list of integers"):
        run_sequential(tmp_path / "seq", ["plate"], seeds=seeds, steps=2)
    assert not (tmp_path / "seq" / "sequential.json").exists()


@pytest.mark.parametrize("names", [None, 3, b"q_proj", ["q_proj", 1]])
def test_names_that_are_not_strings_are_one_config_error(names, tmp_path):
    """targets.name_list serves every list of names (target modules, methods): a number or None was a TypeError
    from deep inside, bytes became a list of numbers."""
    from plate_inspect.experiments.sequential_tasks import run_sequential
    from plate_inspect.targets import name_list

    with pytest.raises(ConfigError, match="names must be a name or a list of names"):
        name_list(names)
    with pytest.raises(ConfigError, match="methods must be a name or a list of names"):
        run_sequential(tmp_path / "seq", names, seeds=1, steps=2)
    assert name_list("q_proj") == ["q_proj"] and name_list(("a", "b")) == ["a", "b"]
