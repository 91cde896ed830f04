"""Python API arguments of the wrong kind: one ConfigError naming the argument and what it takes, raised before any
work (not an AttributeError from ``str.split``, not a TypeError from deep inside run_scan after a merge was written)."""

from __future__ import annotations

import pytest
from helpers_train import digits_setup, load_digits

import plate_inspect.train.sequential as sequential
from plate_inspect.arguments import text_argument
from plate_inspect.errors import ConfigError
from plate_inspect.experiments.methods import parse_methods
from plate_inspect.train.layer import apply_bundle, save_adapter


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


@pytest.fixture(scope="module")
def digits_adapter(tmp_path_factory):
    """A digits checkpoint, its bundle, and a save_adapter file of it."""
    root = tmp_path_factory.mktemp("edges")
    _, ckpt, bundle = digits_setup(root, r=8, tau=0.8)
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    return ckpt, bundle, save_adapter(model, root / "adapter.safetensors")


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
