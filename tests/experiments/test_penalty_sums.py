"""The arena's loss penalties are tensors for every input their annotations allow, an empty list of layers included.

``sum`` of no terms is the int 0, so ``lam * sum(...)`` gave the float 0.0 for empty inputs (no ``.item()``,
``.backward()`` or ``.device``), where a tensor is promised. Oracles: 0 for no terms; hand sums otherwise.
"""

from __future__ import annotations

import torch

from plate_inspect.experiments import methods as M


def test_penalties_of_no_layers_are_zero_tensors():
    for penalty in (M.l2_init_penalty([], [], 0.5), M.olora_penalty([], [], 0.5)):
        assert isinstance(penalty, torch.Tensor) and penalty.ndim == 0
        assert penalty.item() == 0.0


def test_penalty_sums_keep_dtype_and_gradient():
    p = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([[3.0]], dtype=torch.float64, requires_grad=True)
    total = M.l2_init_penalty([p, q], [torch.zeros(2, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)], 2.0)
    assert total.dtype == torch.float64 and total.item() == 2.0 * (1 + 4 + 4)  # by hand: 2 (1^2 + 2^2 + 2^2)
    total.backward()
    assert p.grad.tolist() == [4.0, 8.0] and q.grad.tolist() == [[8.0]]  # d/dx 2 (x - a)^2 = 4 (x - a)
