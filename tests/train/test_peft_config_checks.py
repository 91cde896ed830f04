"""PlateConfig's fields are checked when it is made: a wrong type is a ConfigError naming the field, not an
AttributeError or TypeError inside get_peft_model; modules_to_save is read as peft reads a list of names."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers_train import digits_setup, load_digits
from peft import get_peft_model

from plate_inspect.errors import ConfigError
from plate_inspect.train.layer import PlateLinear
from plate_inspect.train.peft import PlateConfig, PlateLayer


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """(checkpoint, bundle path) of an untrained digits MLP (modules fc1, fc2, fc3, head1, head2)."""
    _, ckpt, bundle = digits_setup(tmp_path_factory.mktemp("config_checks"), r=8, tau=0.8)
    return ckpt, str(bundle.path)


def _fully_trained(model) -> list[str]:
    """The modules peft trains in full (modules_to_save), by their model names."""
    return sorted(
        {
            n.split(".modules_to_save.")[0].removeprefix("base_model.model.")
            for n, _ in model.named_parameters()
            if ".modules_to_save." in n
        }
    )


@pytest.mark.parametrize("given", ["head2", ["head2"], ("head2",), {"head2"}])
def test_modules_to_save_one_string_is_one_name(digits, given):
    """'head2' trains head2 alone; peft iterated the string (h, e, a, d, 2): '2' reached fc2, a PLATE layer, and
    get_peft_model failed with a TypeError."""
    ckpt, bundle = digits
    config = PlateConfig(bundle=bundle, modules_to_save=given)
    assert config.modules_to_save == ["head2"]
    model = get_peft_model(load_digits(ckpt), config)
    assert _fully_trained(model) == ["head2"]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert [n for n in trainable if "plate_A" not in n] == [
        "base_model.model.head2.modules_to_save.default.bias",
        "base_model.model.head2.modules_to_save.default.weight",
    ]


@pytest.mark.parametrize("given", [3, [3], ["head2", None], "", [""], ["  "], {"head2": 1}])
def test_modules_to_save_of_the_wrong_kind_is_refused_when_the_config_is_made(digits, given):
    with pytest.raises(ConfigError) as e:
        PlateConfig(bundle=digits[1], modules_to_save=given)
    assert str(e.value) == (
        f"modules_to_save must be a list of module names (e.g. ['classifier']) or None, got {given!r}"
    )


def test_modules_to_save_ending_an_adapted_modules_name_is_refused_with_what_to_do(digits):
    """'2' reaches fc2 by the end of its name: peft tried to save the PLATE layer fully and failed (TypeError)."""
    ckpt, bundle = digits
    with pytest.raises(ConfigError) as e:
        get_peft_model(load_digits(ckpt), PlateConfig(bundle=bundle, modules_to_save=["2"]))
    assert str(e.value) == (
        "PlateConfig: modules_to_save entry '2' ends the name of fc2, which PLATE adapts (peft would save it fully "
        "too, and fail); give whole module names, e.g. 'head2' (a module of the bundle named whole is trained fully "
        "instead of adapted)"
    )


def test_a_bundle_module_named_whole_is_trained_fully_instead_of_adapted(digits):
    """As peft does with LoRA (and README's table says): fc2 in modules_to_save is saved, not PLATE-adapted."""
    ckpt, bundle = digits
    model = get_peft_model(load_digits(ckpt), PlateConfig(bundle=bundle, modules_to_save=["fc2", "head2"]))
    assert _fully_trained(model) == ["fc2", "head2"]
    assert sorted(n for n, m in model.named_modules() if isinstance(m, PlateLayer)) == [
        "base_model.model.fc1",
        "base_model.model.fc3",
    ]


def test_modules_to_save_matching_no_module_warns(digits):
    ckpt, bundle = digits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(load_digits(ckpt), PlateConfig(bundle=bundle, modules_to_save=["head", "head1"]))
    messages = [str(w.message) for w in caught if "modules_to_save" in str(w.message)]
    assert messages == [
        "PlateConfig: modules_to_save entry 'head' matches no module of the model and is ignored (it trains the "
        "modules whose name ends with it)"
    ]
    assert _fully_trained(model) == ["head1"]


@pytest.mark.parametrize(
    "field, value, want",
    [
        ("inference_mode", "no", "True or False"),  # 'no' is truthy: a frozen adapter, the opposite of what was meant
        ("check_fingerprints", 0, "True or False"),
        ("carry_geometry", "yes", "True or False"),
        ("bundle_signature", 3, "a string or None (filled in when the adapter is created)"),
        ("bundle_digest", b"x", "a string or None (filled in when the adapter is created)"),
        ("bundle_relative", 3, "a string or None (written by save_pretrained)"),
        ("module_records", "x", "a dict of per-module dicts or None (filled in when the adapter is created)"),
        ("module_records", {"fc1": 3}, "a dict of per-module dicts or None (filled in when the adapter is created)"),
    ],
)
def test_other_fields_of_the_wrong_type_are_refused_when_the_config_is_made(digits, field, value, want):
    """module_records='x' failed inside get_peft_model as "AttributeError: 'str' object has no attribute 'get'"."""
    with pytest.raises(ConfigError) as e:
        PlateConfig(bundle=digits[1], **{field: value})
    assert str(e.value) == f"{field} must be {want}, got {value!r}"


def test_a_saved_adapter_with_modules_to_save_loads_and_matches(digits, tmp_path):
    """The normalised list is what adapter_config.json records; loading rebuilds the same model."""
    from peft import PeftModel

    ckpt, bundle = digits
    model = get_peft_model(load_digits(ckpt), PlateConfig(bundle=bundle, modules_to_save="head2"))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    out = model(x, task=2)
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_digits(ckpt), tmp_path / "adapter")
    assert loaded.peft_config["default"].modules_to_save == ["head2"]
    torch.testing.assert_close(loaded(x, task=2), out, rtol=0, atol=0)
    assert not any(isinstance(m, PlateLinear) for m in loaded.modules())


def test_bundle_may_be_the_bundle_object_scan_returns(digits, tmp_path):
    """``scan()`` returns a Bundle, and apply_bundle takes one; PlateConfig refused it ("bundle must be a path").
    It stands for its directory: the config holds that path and the adapter matches one made from the path."""
    from plate_inspect.bundle import Bundle

    ckpt, bundle = digits
    by_object = PlateConfig(bundle=Bundle.load(bundle))
    assert by_object.bundle == bundle
    a = get_peft_model(load_digits(ckpt), by_object)
    b = get_peft_model(load_digits(ckpt), PlateConfig(bundle=bundle))
    assert a.peft_config["default"].bundle_digest == b.peft_config["default"].bundle_digest
    a.save_pretrained(tmp_path / "adapter")
    assert PlateConfig.from_pretrained(tmp_path / "adapter").bundle == bundle


@pytest.mark.parametrize(("given", "shown"), [([], "[]"), (["zzz", "yyy"], "['yyy', 'zzz']")])
def test_target_modules_matching_nothing_are_shown_as_given(digits, given, shown):
    """The refusal showed peft's set of the list ("target_modules set() match none ..." for an empty list)."""
    from plate_inspect.errors import BundleError

    ckpt, bundle = digits
    with pytest.raises(BundleError, match=rf"^target_modules {re.escape(shown)} match none of the bundle's"):
        get_peft_model(load_digits(ckpt), PlateConfig(bundle=bundle, target_modules=given))
