"""Code paths for APIs an older torch lacks (pyproject's floor is 2.5; these reach back to 2.2), simulated on the
installed torch.

``TORCH=2.5.1 bash scripts/check_floors.sh`` runs the runtime tests on an old torch itself (a multi-GB CUDA build
from PyPI); these tests keep the fallbacks honest on whatever torch the suite runs with.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from helpers_analysis import TinyTransformer, dense_basis, dense_oracles, op_dense

from plate_inspect.analysis import curvature, old_task
from plate_inspect.analysis.curvature import OldTaskProblem, UpdateFamily, restricted_operator, selector_basis_block


def test_curvature_through_attention_without_torch_nn_attention(monkeypatch):
    """torch 2.2 has no torch.nn.attention.sdpa_kernel (new in 2.3): curvature.py imported it at module level, so
    `plate-inspect curvature` and every import of the analysis failed there. Without it, products through attention
    still run on the math kernel (torch.backends.cuda.sdp_kernel; the fused kernels have no double backward, the
    product would raise) and the restricted Hessian equals M^T H M of the dense float64 Hessian."""
    monkeypatch.setattr(old_task, "sdpa_kernel", None)  # as the import leaves it on torch 2.2
    torch.manual_seed(0)
    model = TinyTransformer().double().eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 5, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    q = torch.linalg.qr(torch.randn(4, 2, generator=g, dtype=torch.float64)).Q
    block = selector_basis_block("enc.self_attn.in_proj_weight", (12, 4), torch.tensor([0, 5, 9]), q)  # q, k, v rows
    fam = UpdateFamily("in_proj", [block])
    got = op_dense(restricted_operator(OldTaskProblem(model, F.cross_entropy, [(x, y)]), fam, "hessian"))
    assert torch.backends.cuda.flash_sdp_enabled()  # the fallback restores the global kernel toggles on exit
    monkeypatch.undo()
    with curvature.math_attention():  # the oracle's double backward needs the math kernel too
        hess, _, _, _ = dense_oracles(model, x, y)
    m = dense_basis(fam, model)
    want = (m.T @ hess @ m).numpy()
    assert got.shape == (6, 6)
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10 * np.abs(want).max())
    assert np.abs(want).max() > 1e-3  # a real curvature, not two zero matrices agreeing
