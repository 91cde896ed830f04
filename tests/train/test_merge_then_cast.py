"""Merge, cast (or move) the model, unmerge: the weight is the cast of the original, in both PLATE routes.

merge() keeps the replaced rows of W so that unmerge() restores them bit for bit; those rows stay in the dtype (and on
the device) they had at merge time. ``merge_adapter()`` for fast inference, ``model.to(torch.bfloat16)`` or
``.float()``, then ``unmerge_adapter()`` to go on training failed inside torch ("Index put requires the source and
destination dtypes match"). Oracle: the original weight cast to the new dtype (casting is elementwise, so restoring
the rows and casting commute), bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers_train import digits_setup, load_digits
from peft import get_peft_model

from plate_inspect.train.layer import apply_bundle, merge_all, plate_layers, unmerge_all
from plate_inspect.train.peft import PlateConfig, PlateLayer


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    _, ckpt, bundle = digits_setup(tmp_path_factory.mktemp("merge_cast"), r=8, tau=0.8)
    return ckpt, bundle


def _randomize(params) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize(("first", "then"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float64)])
def test_apply_bundle_unmerge_after_a_cast(digits, first, then):
    ckpt, bundle = digits
    model = load_digits(ckpt).to(first)
    _randomize(apply_bundle(model, bundle))
    original = {n: layer.weight.detach().clone() for n, layer in plate_layers(model).items()}
    merge_all(model)
    model.to(then)
    unmerge_all(model)
    for name, layer in plate_layers(model).items():
        assert not layer.merged
        assert layer.weight.dtype == then and torch.equal(layer.weight, original[name].to(then))


@pytest.mark.parametrize(("first", "then"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float64)])
def test_peft_unmerge_adapter_after_a_cast(digits, first, then):
    ckpt, bundle = digits
    model = get_peft_model(load_digits(ckpt).to(first), PlateConfig(bundle=str(bundle.path)))
    _randomize([p for n, p in model.named_parameters() if "plate_A" in n])
    layers = {n: m for n, m in model.named_modules() if isinstance(m, PlateLayer)}
    original = {n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    model.merge_adapter()
    model.to(then)
    model.unmerge_adapter()
    for name, layer in layers.items():
        weight = layer.get_base_layer().weight
        assert not layer.merged and weight.dtype == then and torch.equal(weight, original[name].to(then))
