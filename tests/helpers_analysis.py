"""Dense float64 oracles of the analyses, for tests in several directories (analysis/, tooling/): tiny models and
their data, the Hessian, GGN and Jacobian Gram straight from torch.autograd.functional, an update family's basis as
a dense matrix, and weight-vs-activation alignment by its definition in numpy."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plate_inspect.analysis.curvature import UpdateFamily


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def tiny_data(n: int = 12, d_in: int = 3, classes: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def unflatten(model: nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for n, p in model.named_parameters():
        out[n] = flat[i : i + p.numel()].reshape(p.shape)
        i += p.numel()
    return out


def dense_oracles(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=F.cross_entropy):
    """H0, GGN and E[J^T J] as dense matrices, straight from torch.autograd.functional."""
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def outputs(flat):
        return functional_call(model, unflatten(model, flat), (x,))

    def loss(flat):
        return loss_fn(outputs(flat), y)

    hess = torch.autograd.functional.hessian(loss, theta)
    jac = torch.autograd.functional.jacobian(outputs, theta)  # [N, C, P]
    out = outputs(theta).detach()
    n = x.shape[0]
    ggn = torch.zeros_like(hess)
    gram = torch.zeros_like(hess)
    for i in range(n):
        h_out = torch.autograd.functional.hessian(lambda o, i=i: loss_fn(o[None], y[i : i + 1]), out[i])
        ggn += jac[i].T @ h_out @ jac[i] / n
        gram += jac[i].T @ jac[i] / n
    return hess, ggn, gram, theta


def dense_basis(family: UpdateFamily, model: nn.Module) -> torch.Tensor:
    """M as a dense [P, m] matrix (columns: embedded unit coordinates, flattened in parameter order)."""
    cols = []
    for j in range(family.dim):
        e = torch.zeros(family.dim, dtype=torch.float64)
        e[j] = 1.0
        delta = family.embed(e)
        cols.append(torch.cat([delta.get(n, torch.zeros_like(p)).reshape(-1) for n, p in model.named_parameters()]))
    return torch.stack(cols, dim=1)


def op_dense(op) -> np.ndarray:
    return np.column_stack([op.matvec(e) for e in np.eye(op.shape[0])])


class TinyTransformer(nn.Module):
    """One post-norm encoder layer (attention, LayerNorm, ReLU FFN), mean-pooled, a linear head: 3 classes."""

    def __init__(self, d: int = 4, ff: int = 6, classes: int = 3):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d, 1, ff, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(dim=1))


def alignment_oracle(w: np.ndarray, x: np.ndarray, k: int):
    """VE_k of the top-k right singular vectors of W and of the top-k eigvecs of X^T X / N, and AL_k, by definition."""
    sigma = x.T @ x / x.shape[0]
    _, _, vt = np.linalg.svd(w)
    v = vt[:k].T
    evals, evecs = np.linalg.eigh(sigma)
    u = evecs[:, ::-1][:, :k]
    tr = np.trace(sigma)
    return np.trace(v.T @ sigma @ v) / tr, np.trace(u.T @ sigma @ u) / tr, np.linalg.norm(u.T @ v) ** 2 / k
