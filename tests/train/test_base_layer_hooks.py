"""A forward hook on the frozen layer a PLATE layer wraps sees that layer's own output.

The branch is added in place into the base layer's fresh output (no extra n x d_out tensor). With a forward hook on
the base layer (activation capture, distillation targets), the hook's tensor was that same one, so it silently
became base + branch. Now the branch is added in place only when no hook can hold the output. Oracles: the dense
float64 base output x W^T + b, and the dense PLATE output x (W + rho E_B A Q^T)^T + b.
"""

from __future__ import annotations

import pytest
import torch
from helpers_train import dense_plate_weight, digits_setup, load_digits
from peft import get_peft_model
from torch import nn

from plate_inspect.train.layer import PlateLinear
from plate_inspect.train.peft import PlateConfig, PlateLayer


def _plate_linear() -> PlateLinear:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = PlateLinear(nn.Linear(8, 6), torch.tensor([0, 2, 5]), torch.linalg.qr(torch.randn(8, 4, generator=g))[0])
    with torch.no_grad():
        layer.plate_A.normal_(generator=g)
    return layer


def _check(hook, layer, base, b_idx, a, q, rho, x):
    """The hook's tensor is the base output; the layer's is base + branch. ``hook``: "layer" registers it on the base
    layer; "global" for every module (register_module_forward_hook: activation tracers, profilers), which saw base +
    branch while the in-place rule looked at the layer's own hooks only."""
    kept = []
    if hook == "layer":
        handle = base.register_forward_hook(lambda module, args, out: kept.append(out))
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: kept.append(out) if module is base else None
        )
    try:
        y = layer(x)
    finally:
        handle.remove()
    w, bias = base.weight.detach(), base.bias.detach().double()
    torch.testing.assert_close(kept[0].double(), x.double() @ w.double().T + bias, rtol=0, atol=1e-5)
    want = x.double() @ dense_plate_weight(w, b_idx, a.detach(), q, rho).T + bias
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5)
    assert (kept[0] - y).abs().max() > 1e-2  # the branch is there, in the layer's output only


HOOKS = ["layer", "global"]


@pytest.mark.parametrize("hook", HOOKS)
def test_plate_linear_hook_sees_the_base_output(hook):
    layer = _plate_linear()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    _check(hook, layer, layer.base, layer.plate_B_idx, layer.plate_A, layer.plate_Q, layer.rho, x)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    _, ckpt, bundle = digits_setup(tmp_path_factory.mktemp("base_hooks"), r=8, tau=0.8)
    return ckpt, bundle


@pytest.mark.parametrize("hook", HOOKS)
def test_peft_hook_sees_the_base_output(digits, hook):
    ckpt, bundle = digits
    model = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path), rho=0.7))
    layer = next(m for m in model.modules() if isinstance(m, PlateLayer))
    with torch.no_grad():
        layer.plate_A["default"].normal_(generator=torch.Generator().manual_seed(2))
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(3))
    b_idx, q = layer.plate_B_idx["default"], layer.plate_Q["default"]
    _check(hook, layer, layer.get_base_layer(), b_idx, layer.plate_A["default"], q, 0.7, x)
