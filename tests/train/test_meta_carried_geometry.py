"""A PlateLinear made on a meta-device weight whose B/Q come with a state dict (``AwaitingWeights.bundle=None``).

``AwaitingWeights`` allows ``bundle=None`` ("the state dict carries B/Q"); settling such a layer read B/Q from the
absent bundle as None and failed on ``None.to`` (AttributeError). Now B/Q stay as the state dict gave them.
Oracle: the dense float64 map W x + b + rho * scatter_B(A Q^T x), computed by hand from the loaded tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from plate_inspect.train.core import geometry_digest
from plate_inspect.train.layer import AwaitingWeights, PlateLinear, finish_meta_init

D_IN, D_OUT, RHO = 6, 5, 0.5


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(D_IN, 3, generator=gen, dtype=torch.float64))
    return {
        "base.weight": torch.randn(D_OUT, D_IN, generator=gen),
        "base.bias": torch.randn(D_OUT, generator=gen),
        "plate_B_idx": torch.tensor([3, 1]),
        "plate_Q": q.float(),
        "plate_A": torch.randn(2, 3, generator=gen),
    }


def _meta_layer(state: dict[str, torch.Tensor]) -> PlateLinear:
    """The layer as made beside a meta weight, then materialised (to_empty wipes everything: B/Q included)."""
    with torch.device("meta"):
        base = nn.Linear(D_IN, D_OUT)
    b_idx, q = state["plate_B_idx"], state["plate_Q"]
    awaiting = AwaitingWeights(
        name="fc", record=None, check_fingerprint=False, reference=None, bundle=None, bundle_module="fc", k=None,
        digest=geometry_digest(b_idx, q),
    )  # fmt: skip
    layer = PlateLinear(base, torch.arange(2), torch.zeros_like(q), rho=RHO, awaiting=awaiting)  # placeholders
    return layer.to_empty(device="cpu")


def _dense(state: dict[str, torch.Tensor], x: torch.Tensor, with_a: bool = True) -> torch.Tensor:
    w, b = state["base.weight"].double(), state["base.bias"].double()
    y = x.double() @ w.T + b
    if with_a:
        branch = x.double() @ state["plate_Q"].double() @ state["plate_A"].double().T  # [n, r]
        for i, row in enumerate(state["plate_B_idx"].tolist()):
            y[:, row] += RHO * branch[:, i]
    return y


def test_first_forward_keeps_the_geometry_a_state_dict_gave():
    state = _tensors()
    layer = _meta_layer(state)
    layer.load_state_dict(state)
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(1))
    y = layer(x)  # settles: no bundle to reload B/Q from, so they stay as loaded
    assert not layer._awaiting
    assert torch.equal(layer.plate_B_idx, state["plate_B_idx"]) and torch.equal(layer.plate_Q, state["plate_Q"])
    torch.testing.assert_close(y.double(), _dense(state, x), rtol=1e-5, atol=1e-5)


def test_finish_meta_init_zeroes_a_and_keeps_the_loaded_geometry():
    state = _tensors()
    layer = _meta_layer(state)
    layer.load_state_dict({k: v for k, v in state.items() if k != "plate_A"}, strict=False)
    assert finish_meta_init(layer) == 1
    assert not layer.plate_A.any()
    assert torch.equal(layer.plate_B_idx, state["plate_B_idx"]) and torch.equal(layer.plate_Q, state["plate_Q"])
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x).double(), _dense(state, x, with_a=False), rtol=1e-5, atol=1e-5)
