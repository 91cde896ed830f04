"""The `plate` PEFT method used the way people use PEFT adapters.

Each test covers a problem users met: add_weighted_adapter (missing: a misleading AttributeError), LoRA options
given to PlateConfig (a bare TypeError), a PlateConfig reused for another model or bundle (get_peft_model filled
the caller's object, so the reuse was refused as "trained with another bundle"), and an adapter directory moved
together with its bundle (refused: only the absolute bundle path was recorded). Oracles: a float64 copy of the base
model with W[B] += rho A Q^T written in (dense), and the logits of the adapter before it was saved.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers_train import save_tiny_qwen2
from peft import PeftModel, get_peft_model

from plate_inspect import scan
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.train.peft import PlateConfig, PlateLayer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Two tiny Qwen2 checkpoints (other weights) and bundles: two of the first model (r = 4 and r = 6, so other B
    and Q), one of the second."""
    root = tmp_path_factory.mktemp("train_ux")
    save_tiny_qwen2(root / "model")
    save_tiny_qwen2(root / "model2", seed=1)
    scan(root / "model", root / "bundle", r=4, tau=0.8, max_rank=16, overwrite=True)
    scan(root / "model", root / "bundle_r6", r=6, tau=0.8, max_rank=16, overwrite=True)
    scan(root / "model2", root / "bundle_m2", r=4, tau=0.8, max_rank=16, overwrite=True)
    return root


def _base(root, name="model"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32)


def _ids():
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _randomize(pm, adapter: str, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in pm.modules():
            if isinstance(layer, PlateLayer) and adapter in layer.plate_A:
                a = layer.plate_A[adapter]
                a.copy_(torch.randn(a.shape, generator=g) * scale)


def _updates(pm, adapter: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Per module (the checkpoint's name): B, Q, A and rho of one adapter, read from the layers."""
    out = {}
    for name, layer in pm.named_modules():
        if isinstance(layer, PlateLayer) and adapter in layer.plate_A:
            module = name.removeprefix("base_model.model.")
            b, q, a = layer.plate_B_idx[adapter], layer.plate_Q[adapter], layer.plate_A[adapter]
            out[module] = (b.clone(), q.detach().clone(), a.detach().clone(), layer.plate_rho[adapter])
    return out


def _dense_logits(root, terms: list[tuple[float, dict]], name: str = "model") -> torch.Tensor:
    """Logits of a float64 copy of the base model with W[B] += w rho A Q^T written in for every (w, updates) term."""
    model = _base(root, name).double()
    with torch.no_grad():
        for w, updates in terms:
            for module, (b, q, a, rho) in updates.items():
                weight = model.get_submodule(module).weight
                e_b = torch.zeros(weight.shape[0], b.numel(), dtype=torch.float64)
                e_b[b, torch.arange(b.numel())] = 1.0
                weight += w * rho * e_b @ a.double() @ q.double().T
    return _logits(model)


def test_add_weighted_adapter_is_the_weighted_sum_and_refuses_other_geometry(qwen, tmp_path):
    """A linear combination of adapters from one bundle (other rho, other module subsets) equals the dense oracle
    W + sum_i w_i rho_i B A_i Q^T, saves and reloads bit for bit; other B/Q and other combination types: one line."""
    pm = get_peft_model(_base(qwen), PlateConfig(bundle=str(qwen / "bundle"), rho=0.5))
    pm.add_adapter("two", PlateConfig(bundle=str(qwen / "bundle"), rho=0.25, target_modules=["q_proj", "v_proj"]))
    _randomize(pm, "default", 1)
    _randomize(pm, "two", 2)
    terms = [(0.7, _updates(pm, "default")), (-0.3, _updates(pm, "two"))]
    pm.add_weighted_adapter(["default", "two"], [0.7, -0.3], "mix")
    assert pm.active_adapters == ["default"]
    assert not any(p.requires_grad for n, p in pm.named_parameters() if n.endswith(".mix"))  # frozen until set
    pm.set_adapter("mix")
    mix = _logits(pm)
    oracle = _dense_logits(qwen, terms)
    torch.testing.assert_close(mix.double(), oracle, rtol=0, atol=2e-5 * oracle.abs().max().item())
    assert (mix - _logits(_base(qwen))).abs().max() > 1e-2  # the update is not negligible
    pm.save_pretrained(tmp_path / "adapters")
    loaded = PeftModel.from_pretrained(_base(qwen), tmp_path / "adapters" / "mix")
    assert torch.equal(_logits(loaded), mix)

    pm.add_adapter("r6", PlateConfig(bundle=str(qwen / "bundle_r6"), rho=0.5))
    with pytest.raises(ConfigError, match=r"^add_weighted_adapter: adapters 'default' and 'r6' have different B/Q"):
        pm.add_weighted_adapter(["default", "r6"], [0.5, 0.5], "bad")
    with pytest.raises(ConfigError, match=r"combination_type 'svd': PLATE adapters combine linearly only"):
        pm.add_weighted_adapter(["default", "two"], [0.5, 0.5], "bad", combination_type="svd")
    with pytest.raises(ConfigError, match=r"an adapter named 'two' exists already"):
        pm.add_weighted_adapter(["default"], [1.0], "two")
    assert "bad" not in pm.peft_config


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        ({"r": 8}, r"'r' \(a LoRA option\): r and k per module come from the bundle \(plate-inspect scan --r"),
        ({"lora_alpha": 16}, r"'lora_alpha' \(a LoRA option\): the update's scale is rho"),
        ({"layers_to_transform": [0]}, r"'layers_to_transform' .*target_modules .*scan --layers"),
    ],
    ids=["r", "lora_alpha", "layers_to_transform"],
)
def test_lora_options_are_refused_naming_plates_way(qwen, option, hint):
    with pytest.raises(ConfigError, match=r"^PlateConfig has no option " + hint):
        PlateConfig(bundle=str(qwen / "bundle"), **option)


def test_a_config_is_reusable_for_another_model_and_bundle(qwen):
    """get_peft_model leaves the caller's PlateConfig as given: one config object serves two models (the second with
    its own bundle), each equal to its dense oracle; the PEFT model's own config holds the records."""
    config = PlateConfig(bundle=str(qwen / "bundle"), target_modules=["q_proj"])
    first = get_peft_model(_base(qwen), config)
    assert config.module_records is None and first.peft_config["default"].module_records
    config.bundle = str(qwen / "bundle_m2")
    second = get_peft_model(_base(qwen, "model2"), config)
    _randomize(second, "default", 3)
    oracle = _dense_logits(qwen, [(1.0, _updates(second, "default"))], name="model2")
    torch.testing.assert_close(_logits(second).double(), oracle, rtol=0, atol=2e-5 * oracle.abs().max().item())


def test_adapter_moved_together_with_its_bundle_loads(qwen, tmp_path):
    """adapter_config.json records the bundle relative to the adapter directory too: a project directory holding
    both, moved elsewhere, loads with bit-identical logits (also a second adapter in a subdirectory); the bundle
    moved alone is refused in one line naming both places looked at."""
    project = tmp_path / "project"
    shutil.copytree(qwen / "bundle", project / "bundles" / "mine")
    pm = get_peft_model(_base(qwen), PlateConfig(bundle=str(project / "bundles" / "mine")))
    pm.add_adapter("two", PlateConfig(bundle=str(project / "bundles" / "mine"), rho=0.1))
    _randomize(pm, "default", 4)
    _randomize(pm, "two", 5)
    out = _logits(pm)
    pm.set_adapter("two")
    out_two = _logits(pm)
    pm.save_pretrained(project / "adapters" / "task1")
    saved = json.loads((project / "adapters" / "task1" / "adapter_config.json").read_text())
    assert saved["bundle"] == str(project / "bundles" / "mine") and saved["bundle_relative"] == "../../bundles/mine"
    assert pm.peft_config["default"].bundle_relative is None  # saving leaves the live config as it was
    shutil.move(project, tmp_path / "moved")
    adapter = tmp_path / "moved" / "adapters" / "task1"
    loaded = PeftModel.from_pretrained(_base(qwen), adapter)
    loaded.load_adapter(adapter / "two", adapter_name="two")
    assert loaded.peft_config["default"].bundle == str(tmp_path / "moved" / "bundles" / "mine")
    assert torch.equal(_logits(loaded), out)
    loaded.set_adapter("two")
    assert torch.equal(_logits(loaded), out_two)
    shutil.move(tmp_path / "moved" / "bundles", tmp_path / "elsewhere")
    with pytest.raises(BundleError, match=r"is not there, nor at \.\./\.\./bundles/mine from the adapter directory"):
        PeftModel.from_pretrained(_base(qwen), adapter)
