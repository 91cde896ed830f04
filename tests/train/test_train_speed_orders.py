"""Every evaluation order of the PLATE branch against a dense float64 oracle: outputs, grad A, grad x; dtypes,
gradient checkpointing, torch.compile; the order chooser against hand-computed costs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plate_inspect.errors import BundleError
from plate_inspect.geometry import random_orthonormal, random_rows
from plate_inspect.train.core import ALL_ORDERS, BranchOrder, branch_costs, choose_order
from plate_inspect.train.layer import PlateLinear

D_IN, D_OUT, R, K, RHO = 48, 40, 6, 20, 0.5


def _layer(seed: int = 0, dtype=torch.float32) -> tuple[PlateLinear, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    base = nn.Linear(D_IN, D_OUT)
    nn.init.normal_(base.bias)
    b_idx, q = random_rows(D_OUT, R, seed + 1), random_orthonormal(D_IN, K, seed + 2)
    layer = PlateLinear(base, b_idx, q, rho=RHO)
    with torch.no_grad():
        layer.plate_A.copy_(torch.randn(R, K, generator=torch.Generator().manual_seed(seed + 3)))
    layer.to(dtype)
    return layer, b_idx, q, base.weight.detach().double().clone()


def _oracle(x: torch.Tensor, layer: PlateLinear, w: torch.Tensor, b_idx, q):
    """y = x (W + rho E_B A Q^T)^T + bias, with grad A and grad x of sum(y * c), all float64."""
    a = layer.plate_A.detach().double().requires_grad_(True)
    xd = x.detach().double().requires_grad_(True)
    e_b = torch.zeros(D_OUT, R, dtype=torch.float64)
    e_b[b_idx, torch.arange(R)] = 1.0
    y = xd @ (w + RHO * e_b @ a @ q.double().T).T + layer.base.bias.detach().double()
    c = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
    (y * c).sum().backward()
    return y.detach(), a.grad, xd.grad, c


def _run(layer: PlateLinear, x: torch.Tensor, c: torch.Tensor, order: BranchOrder | None, autocast=None):
    from plate_inspect.train import core

    layer.plate_A.grad = None
    xi = x.detach().clone().requires_grad_(True)
    original = core.choose_order
    if order is not None:
        core.choose_order = lambda *a, **k: order
    try:
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                y = layer(xi)
        else:
            y = layer(xi)
        (y.double() * c).sum().backward()
    finally:
        core.choose_order = original
    return y.detach().double(), layer.plate_A.grad.double(), xi.grad.double()


def _name(order: BranchOrder | None) -> str:
    return "auto" if order is None else "-".join(vars(order).values())


@pytest.mark.parametrize("order", [*ALL_ORDERS, None], ids=_name)
def test_every_order_matches_dense_oracle_float32(order):
    layer, b_idx, q, w = _layer(0)
    x = torch.randn(2, 7, D_IN, generator=torch.Generator().manual_seed(9))
    y_o, ga_o, gx_o, c = _oracle(x, layer, w, b_idx, q)
    y, ga, gx = _run(layer, x, c, order)
    torch.testing.assert_close(y, y_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga, ga_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_o, rtol=1e-5, atol=1e-5)
    assert layer.plate_Q.grad is None and not layer.plate_Q.requires_grad  # Q is frozen
    assert all(p.grad is None for p in layer.base.parameters())


@pytest.mark.parametrize("order", ALL_ORDERS, ids=_name)
@pytest.mark.parametrize("mode", ["bf16-autocast", "fp16"])
def test_every_order_matches_oracle_in_low_precision(order, mode):
    dtype = torch.float16 if mode == "fp16" else torch.float32
    layer, b_idx, q, w = _layer(1, dtype)
    x = torch.randn(3, 5, D_IN, generator=torch.Generator().manual_seed(4))
    y_o, ga_o, gx_o, c = _oracle(x, layer, w, b_idx, q)
    if mode == "fp16":  # weights, Q, A and x in float16; the oracle uses the same rounded A and W
        y_o, ga_o, gx_o, c = _oracle(x.half(), layer, layer.base.weight.detach().double(), b_idx, layer.plate_Q)
        y, ga, gx = _run(layer, x.half(), c, order)
        assert layer.plate_A.grad.dtype == torch.float16
        tol = 3e-3
    else:
        y, ga, gx = _run(layer, x, c, order, autocast=torch.bfloat16)
        assert layer.plate_A.grad.dtype == torch.float32  # A stays float32 under autocast
        tol = 3e-2
    scale = lambda t: tol * t.abs().max().item()  # noqa: E731 - low precision: error relative to the magnitude
    torch.testing.assert_close(y, y_o, rtol=0, atol=scale(y_o))
    torch.testing.assert_close(ga, ga_o, rtol=0, atol=scale(ga_o))
    torch.testing.assert_close(gx, gx_o, rtol=0, atol=scale(gx_o))


def test_rows_outside_b_are_the_base_output_bit_for_bit():
    """B is an index: the r rows are scattered, every other output feature is exactly the frozen layer's."""
    layer, b_idx, _, _ = _layer(2)
    x = torch.randn(11, D_IN)
    y, base = layer(x), layer.base(x)
    others = torch.ones(D_OUT, dtype=torch.bool)
    others[b_idx] = False
    assert torch.equal(y[:, others], base[:, others])
    assert not torch.equal(y[:, b_idx], base[:, b_idx])


def test_order_chooser_against_hand_computed_costs():
    # n=1, d_in=64, k=32, r=4: xq forward 1*64*32 + 1*32*4 = 2176; m forward 4*32*64 + 1*64*4 = 8448
    xq_fwd = BranchOrder("xq", "z", "a")
    assert branch_costs(xq_fwd, 1, 64, 32, 4, need_grad_x=False) == 2176 + 1 * 32 * 4  # + grad A = Z^T g
    assert choose_order(1, 64, 32, 4).forward == "xq"
    # n=4096 rows: forming M = A Q^T once is cheaper (LoRA-like)
    big = choose_order(4096, 1024, 512, 64)
    assert big == BranchOrder("m", "gx", "m")
    assert branch_costs(big, 4096, 1024, 512, 64) == 2 * 64 * 512 * 1024 + 3 * 4096 * 1024 * 64
    for n in (1, 8, 64, 512, 4096):
        best = choose_order(n, 1024, 512, 64)
        assert all(branch_costs(best, n, 1024, 512, 64) <= branch_costs(o, n, 1024, 512, 64) for o in ALL_ORDERS)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_matches(reentrant):
    from torch.utils.checkpoint import checkpoint

    grads = []
    for use in (False, True):
        layer, *_ = _layer(3)
        act = nn.Sequential(layer, nn.GELU())
        x = torch.randn(6, D_IN, requires_grad=reentrant)  # reentrant checkpointing needs an input with grad
        y = checkpoint(act, x, use_reentrant=reentrant) if use else act(x)
        y.square().sum().backward()
        grads.append(layer.plate_A.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_torch_compile_matches_eager():
    torch.manual_seed(5)
    layers = []
    for seed in range(2):
        layer, *_ = _layer(10 + seed)
        layers.append(layer)
    model = nn.Sequential(layers[0], nn.ReLU(), nn.Linear(D_OUT, D_IN), layers[1])
    for p in model[2].parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 9, D_IN)
    eager = model(x)
    eager.square().sum().backward()
    g_eager = [lay.plate_A.grad.clone() for lay in layers]
    for lay in layers:
        lay.plate_A.grad = None
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for lay, g in zip(layers, g_eager, strict=True):
        torch.testing.assert_close(lay.plate_A.grad, g, rtol=1e-5, atol=1e-5)


def test_b_and_q_are_validated():
    base = nn.Linear(D_IN, D_OUT)
    q = random_orthonormal(D_IN, K, 0)
    with pytest.raises(BundleError, match="outside"):
        PlateLinear(base, torch.tensor([0, D_OUT]), q)
    with pytest.raises(BundleError, match="repeated"):
        PlateLinear(base, torch.tensor([1, 1]), q)
    with pytest.raises(BundleError, match="integer"):
        PlateLinear(base, torch.tensor([1.0, 2.0]), q)
    with pytest.raises(BundleError, match="d_in"):
        PlateLinear(base, torch.tensor([1, 2]), q[:-1])


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    """The default backend (inductor, generated C++ on CPU) on the same model: slow, so not in the default run."""
    layer, *_ = _layer(12)
    x = torch.randn(4, 9, D_IN)
    eager = layer(x)
    eager.square().sum().backward()
    g = layer.plate_A.grad.clone()
    layer.plate_A.grad = None
    out = torch.compile(layer)(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.plate_A.grad, g, rtol=1e-5, atol=1e-5)
