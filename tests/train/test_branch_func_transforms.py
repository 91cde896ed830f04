"""torch.func transforms on PLATE layers: per-sample gradients (vmap of grad) and jacrev, in every evaluation order.

The branch's custom autograd function was written in the ``forward(ctx, ...)`` form, which torch.func refuses
("In order to use an autograd.Function with functorch transforms ... it must override the setup_context
staticmethod"): per-sample gradients (DP-SGD, influence functions) failed on any PLATE model while they work on
LoRA's plain ops. Forward mode (torch.func.jvp) stays unsupported: torch.compile cannot trace a Function with a
custom jvp. Oracle: the dense float64 map y = x (W + rho E_B A Q^T)^T + b, its per-sample gradients in A computed
one sample at a time by reverse mode, and its Jacobian in x (W + rho E_B A Q^T itself, per token).
"""

from __future__ import annotations

import pytest
import torch
from helpers_train import dense_plate_weight
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from plate_inspect.train.core import ALL_ORDERS, BranchOrder, add_branch
from plate_inspect.train.layer import PlateLinear

RHO = 0.7


def _layer() -> PlateLinear:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    q = torch.linalg.qr(torch.randn(8, 4, generator=g))[0]
    layer = PlateLinear(nn.Linear(8, 6), torch.tensor([0, 2, 5]), q, rho=RHO)
    with torch.no_grad():
        layer.plate_A.normal_(generator=g)
    return layer


def _oracle(layer: PlateLinear, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w = dense_plate_weight(layer.base.weight.detach(), layer.plate_B_idx, a, layer.plate_Q, RHO)
    return x.double() @ w.T + layer.base.bias.detach().double()


def _apply(layer: PlateLinear, a: torch.Tensor, x: torch.Tensor, order: BranchOrder | None) -> torch.Tensor:
    """The layer's forward with A given (as functional_call gives it) and the order fixed (None: the layer's own)."""
    if order is None:
        return functional_call(layer, {"plate_A": a}, (x,))
    return add_branch(layer.base(x), x, layer.plate_B_idx, layer.plate_Q, a, RHO, order=order)


@pytest.mark.parametrize("order", [None, *ALL_ORDERS], ids=lambda o: "auto" if o is None else repr(o))
def test_per_sample_gradients_and_jacobian_match_the_dense_oracle(order):
    layer = _layer()
    a0 = layer.plate_A.detach().clone()
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1))  # 5 samples of 3 tokens

    def loss(a, xi):
        return _apply(layer, a, xi, order).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(a0, x)
    for i in range(x.shape[0]):
        a = a0.double().requires_grad_(True)
        _oracle(layer, a, x[i]).square().sum().backward()
        torch.testing.assert_close(per_sample[i].double(), a.grad, rtol=1e-5, atol=1e-5)

    jac = jacrev(lambda xx: _apply(layer, a0, xx, order))(x[0])  # [3, 6, 3, 8]: token t's output on token t
    w = dense_plate_weight(layer.base.weight.detach(), layer.plate_B_idx, a0, layer.plate_Q, RHO)
    for t in range(3):
        torch.testing.assert_close(jac[t, :, t].double(), w, rtol=1e-5, atol=1e-5)
        assert not jac[t, :, [u for u in range(3) if u != t]].any()
