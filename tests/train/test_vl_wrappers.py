"""Bundles of vision-language wrappers onto the models transformers loads: transformers 5 saves LLaVA / Mistral-3 /
Qwen2-VL under their older names (``language_model.model.layers.0...``, ``model.layers.0...``) and renames them when
it loads (``model.language_model.layers.0...``). apply_bundle and the PEFT method map the bundle's names through
transformers' own checkpoint renamings; before, LLaVA's and Mistral-3's bundles were refused as "made for another
model" and Qwen2-VL's mapped by suffix only where that happened to be unique.

Oracle: the module a bundle name lands on holds the very matrix the scan read (compared by value), and its output is
the dense x (W + rho E_B A Q^T)^T from the bundle's B and Q (tests/helpers_train.py)."""

from __future__ import annotations

import pytest
import torch
from checkpoint.test_modern_families import WRAPPERS, tiny_model
from helpers_train import dense_plate_weight, randomize_adapters
from oracles import matrix_key
from safetensors.torch import load_file

import plate_inspect
from plate_inspect.train.layer import apply_bundle, plate_layers

#: Wrappers whose bundle holds Linear modules only (glm4v_moe's experts are fused: tests/train/test_fused_experts.py).
FAMILIES = [f for f in WRAPPERS if f != "glm4v_moe"]


@pytest.fixture(scope="module")
def saved(saved_tiny_model):
    """family -> (directory of the saved model, its bundle), made on first use."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            _, path = saved_tiny_model(family)
            bundle = plate_inspect.scan(path, path.parent / f"{path.name}-bundle", r=2, tau=0.9, max_rank=8)
            cache[family] = (path, bundle)
        return cache[family]

    return get


def _check_layer(layer, bundle, name: str, rho: float) -> None:
    w = dense_plate_weight(layer.base.weight.detach().double(), bundle.b_idx(name), layer.plate_A.detach(),
                           bundle.q(name), rho)  # fmt: skip
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    layer.double()
    bias = 0.0 if layer.base.bias is None else layer.base.bias.detach()
    torch.testing.assert_close(layer(x), x @ w.T + bias, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_bundle_maps_a_wrappers_checkpoint_names_onto_the_loaded_model(saved, family):
    path, bundle = saved(family)
    model = tiny_model(family)  # the same seeded weights, under the names transformers loads them with
    params = apply_bundle(model, bundle, rho=0.5)  # the weight check compares every mapped layer's fingerprint
    layers = plate_layers(model)
    assert len(layers) == len(bundle.modules) and len(params) == len(bundle.modules)
    assert not [n for n in layers if "vision" in n or "visual" in n]
    randomize_adapters(params, seed=3)
    on_disk = load_file(path / "model.safetensors")
    stems = {n: n.removesuffix(".weight") for n in on_disk}
    by_value = {matrix_key(t): stems[n] for n, t in on_disk.items() if stems[n] in bundle}
    for layer_name, layer in layers.items():  # each layer wraps the very matrix its bundle module was scanned from
        assert matrix_key(layer.base.weight) in by_value, layer_name
    name = by_value[matrix_key(next(iter(layers.values())).base.weight)]
    _check_layer(next(iter(layers.values())), bundle, name, 0.5)


@pytest.mark.parametrize("family", ["llava", "mistral3", "qwen2_vl"])
def test_the_peft_method_maps_a_wrappers_bundle_too(saved, family):
    from peft import get_peft_model

    from plate_inspect.train.peft import PlateConfig

    _, bundle = saved(family)
    model = get_peft_model(tiny_model(family), PlateConfig(bundle=str(bundle.path), rho=0.5))
    adapted = {n: m for n, m in model.named_modules() if hasattr(m, "plate_A") and hasattr(m, "base_layer")}
    assert len(adapted) == len(bundle.modules)
    assert not [n for n in adapted if "vision" in n or "visual" in n]
