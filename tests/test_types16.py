"""Bugs found by type-checking the package (session 16): inputs the annotations allow that crashed or misread."""

from __future__ import annotations

import json

import helpers_train
import pytest
import torch
from peft import get_peft_model
from torch import nn

from plate_inspect.analysis.alignment import collect_input_moments, select_linear_modules
from plate_inspect.analysis.curvature import full_family, lora_family, plate_family
from plate_inspect.errors import ConfigError
from plate_inspect.experiments.continual import seed_list
from plate_inspect.train.layer import apply_bundle, load_plan
from plate_inspect.train.peft import PlateConfig


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return helpers_train.digits_setup(tmp_path_factory.mktemp("types16"))


@pytest.mark.parametrize("content", [[1, 2], 3, "plan", None])
def test_plan_file_that_is_not_a_json_object_is_a_config_error(setup, tmp_path, content):
    """A plan file holding a JSON list/number/string/null was an AttributeError ('list' has no attribute 'get')."""
    _, ckpt, bundle = setup
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="not a plate-plan"):
        load_plan(path, bundle)
    with pytest.raises(ConfigError, match="not a plate-plan"):
        apply_bundle(helpers_train.load_digits(ckpt), bundle, plan=path)
    with pytest.raises(ConfigError, match="not a plate-plan"):
        get_peft_model(helpers_train.load_digits(ckpt), PlateConfig(bundle=str(bundle.path), plan=str(path)))


def test_plan_whose_bundle_entry_is_not_an_object_names_the_mismatch(setup):
    """'bundle': "x" (hand-edited) was an AttributeError ('str' has no attribute 'get')."""
    _, _, bundle = setup
    plan = {"format": "plate-plan", "format_version": 1, "bundle": "x", "modules": {"fc1": {"k": 1}}}
    with pytest.raises(ConfigError, match="the plan was made for bundle 'None'"):
        load_plan(plan, bundle)
    plan["bundle"] = {"identity": bundle.manifest.identity}  # the same plan with a proper entry applies
    assert load_plan(plan, bundle) == {"fc1": 1}


def test_one_target_module_string_is_one_pattern_not_its_characters():
    """target_modules="10" (a str is a Sequence[str]) selected layers '1' and '0', one pattern per character."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(11)])
    assert set(select_linear_modules(model, "10")) == {"10"}
    assert set(select_linear_modules(model, ["10"])) == {"10"}
    moments = collect_input_moments(model, [torch.randn(4, 3)], target_modules="10")
    assert set(moments) == {"10"}
    assert moments["10"].n == 4


def test_one_name_string_in_the_curvature_families_is_one_name():
    """full_family / lora_family took "10" as the names '1' and '0' (a silently different family)."""
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(11)])
    assert [b.param for b in full_family(model, "10.weight").blocks] == ["10.weight"]
    assert full_family(model, "10.weight").dim == 9
    assert [b.param for b in lora_family(model, "10", rank=1).blocks] == ["10.weight"]
    assert [b.param for b in lora_family(model, ["10"], rank=1).blocks] == ["10.weight"]


def test_one_module_string_in_plate_family_is_one_module(setup):
    """plate_family(modules="fc2") looked for modules 'f', 'c' and '2' (CurvatureError)."""
    _, ckpt, bundle = setup
    family = plate_family(helpers_train.load_digits(ckpt), bundle, modules="fc2")
    assert [b.param for b in family.blocks] == ["fc2.weight"]
    assert family.dim == bundle.record("fc2").r * bundle.record("fc2").k


@pytest.mark.parametrize("seeds", [True, 2.5, None])
def test_seeds_that_are_neither_a_count_nor_a_list_are_a_config_error(seeds):
    """seed_list(True) (a bool is an int to a type checker) was a TypeError: 'bool' object is not iterable."""
    with pytest.raises(ConfigError, match="seeds must be a count or a list of integers"):
        seed_list(seeds)


def test_seed_counts_and_lists_are_unchanged():
    assert seed_list(3) == [0, 1, 2]
    assert seed_list([4, 2]) == [4, 2]
    assert seed_list((7,)) == [7]
    with pytest.raises(ConfigError, match="at least 1"):
        seed_list(0)
    with pytest.raises(ConfigError, match="integers in"):
        seed_list([1, True])


def test_scan_with_one_target_module_string_scans_that_module(tmp_path):
    """scan(target_modules="q_proj") and ScanSettings(target_modules="q_proj") took each character as a pattern
    ('q', '_', 'p', ...): one string is one pattern, the same bundle as the list of it."""
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.scanner import scan
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "ckpt", layers=1, hidden=32, intermediate=48, heads=4, kv_heads=2)
    assert ScanSettings(target_modules="q_proj").target_modules == ("q_proj",)
    one = scan(ckpt.path, tmp_path / "one", r=4, max_rank=8, anchors=8, target_modules="q_proj")
    listed = scan(ckpt.path, tmp_path / "list", r=4, max_rank=8, anchors=8, target_modules=["q_proj"])
    assert list(one.modules) == list(listed.modules) == ["model.layers.0.self_attn.q_proj"]
    assert one.manifest.identity == listed.manifest.identity
