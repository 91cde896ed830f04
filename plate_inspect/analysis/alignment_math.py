"""The records and pure math of weight-vs-activation alignment: VE_k of three k-frames and AL_k for one layer.

From a layer's weight W [d_out, d_in] and its activation moment Sigma [d_in, d_in] alone (no model, no hooks), so
the definitions can be checked against a dense oracle and reused on moments gathered any way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from plate_inspect.arguments import positive_int, positive_ints, seed_argument
from plate_inspect.errors import AlignmentError, ConfigError
from plate_inspect.geometry import random_orthonormal, symmetric_eigh


@dataclass
class AlignmentRecord:
    """One (module, k) row: variance explained by three k-frames, and weight/activation alignment."""

    module: str
    k: int
    d_in: int
    ve_weight: float
    ve_oracle: float
    ve_random: float
    al_weight: float
    al_chance: float
    n_samples: int = 0

    @property
    def ve_ratio(self) -> float:
        """VE_k(W) / VE_k(random): how many times more activation variance the weight basis captures."""
        return self.ve_weight / self.ve_random if self.ve_random > 0 else float("inf")

    @property
    def al_over_chance(self) -> float:
        """AL_k / (k / d_in): how many times the chance-level alignment of a random k-frame."""
        return self.al_weight / self.al_chance if self.al_chance > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        """The record as the CLI's ``--json`` prints it (exactly these eight keys)."""
        d = asdict(self)
        d.pop("n_samples")
        return d


@dataclass
class ActivationMoments:
    """Streamed second moment of one layer's inputs: sum of x x^T over n rows (float64)."""

    xtx: torch.Tensor  # [d_in, d_in]
    n: int

    @property
    def sigma(self) -> torch.Tensor:
        """Sigma_act = X^T X / N."""
        return self.xtx / max(self.n, 1)


# --------------------------------------------------------------------------- pure math
#: Sigma and W^T W of at most this many input dims are eigendecomposed on one BLAS thread. LAPACK's eigh of such a
#: matrix is mostly level-2 BLAS, each call a handful of microseconds: OpenBLAS's threads gain little there when
#: the machine is quiet, and when it is busy they wait for each other at every call. Measured on 2 cores beside
#: other jobs (load ~15): MiniLM layer 0's six modules 29-35 s wall, 11 s CPU with two threads, 3.5-4.2 s and 1.2 s
#: with one; `plate-inspect align` on MiniLM spent 388 of its 468 s in 72 such eighs. Larger (7B-size d_in 3584,
#: 18944) keep every thread: there the level-3 part pays for them.
ONE_THREAD_EIGH_MAX_DIM = 2048


@contextmanager
def _one_blas_thread() -> Iterator[None]:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def top_right_singular_vectors(weight: torch.Tensor, k: int) -> torch.Tensor:
    """V_k: the top-k eigenvectors of W^T W (top-k right singular vectors of W, padded by null directions)."""
    w = weight.detach().to("cpu", torch.float64)
    _, evecs = symmetric_eigh(w.T @ w)
    return evecs[:, -k:].flip(1).contiguous()


def variance_explained(sigma: torch.Tensor, frame: torch.Tensor) -> float:
    """VE = tr(F^T Sigma F) / tr(Sigma) for an orthonormal frame F (d_in x k)."""
    total = float(torch.diagonal(sigma).sum())
    if total <= 0:
        return 0.0
    return float(((sigma @ frame) * frame).sum()) / total


def alignment_from_moments(
    module: str,
    weight: torch.Tensor,
    sigma: torch.Tensor,
    ks: Sequence[int],
    n_random: int = 8,
    seed: int = 0,
    n_samples: int = 0,
) -> list[AlignmentRecord]:
    """VE_k (weight, oracle, random), AL_k and chance for one layer, from W [d_out, d_in] and Sigma [d_in, d_in]."""
    for argument, value in (("weight", weight), ("sigma", sigma)):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{module}: {argument} must be a torch tensor, got {type(value).__name__}")
    ks = positive_ints(ks, "ks")
    n_random, seed = positive_int(n_random, "n_random"), seed_argument(seed)
    if weight.ndim != 2:
        raise AlignmentError(f"{module}: weight must be 2-D, got shape {list(weight.shape)}")
    d_in = weight.shape[1]
    if tuple(sigma.shape) != (d_in, d_in):
        raise AlignmentError(f"{module}: activation moment is {list(sigma.shape)}, weight has d_in={d_in}")
    sigma = sigma.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(sigma).all()):  # eigh fails on it (LinAlgError), or every figure is NaN
        raise AlignmentError(
            f"{module}: the activation moment holds NaN or Inf: the layer's inputs were not finite (check the inputs "
            "and the model's earlier layers)"
        )
    sigma = 0.5 * (sigma + sigma.T)
    with _one_blas_thread() if d_in <= ONE_THREAD_EIGH_MAX_DIM else nullcontext():
        evals, evecs = symmetric_eigh(sigma)
        w_basis = top_right_singular_vectors(weight, max(ks))
    evals, evecs = evals.flip(0), evecs.flip(1)
    total = float(torch.diagonal(sigma).sum())
    out = []
    rank_bound = min(weight.shape)
    for k in ks:
        if not 1 <= k <= rank_bound:
            raise ConfigError(
                f"{module}: k={k} must lie in 1..min(d_out, d_in)={rank_bound} (beyond W's rank its top-k right "
                "singular directions are arbitrary)"
            )
        if 0 < n_samples < k:
            raise AlignmentError(
                f"{module}: only {n_samples} activation rows for k={k}: the activation covariance has rank <= "
                f"{n_samples}, so its top-{k} subspace holds all the variance and the figures mean nothing; give "
                "more text (--text FILE, --max-tokens) or a smaller --k"
            )
        v_k, u_k = w_basis[:, :k], evecs[:, :k]
        ve_rand = [
            variance_explained(sigma, random_orthonormal(d_in, k, seed=seed + 7919 * i + k, dtype=torch.float64))
            for i in range(n_random)
        ]
        out.append(
            AlignmentRecord(
                module=module,
                k=int(k),
                d_in=int(d_in),
                ve_weight=variance_explained(sigma, v_k),
                ve_oracle=float(evals[:k].clamp_min(0).sum()) / total if total > 0 else 0.0,
                ve_random=sum(ve_rand) / len(ve_rand) if ve_rand else float("nan"),
                al_weight=float((u_k.T @ v_k).pow(2).sum()) / k,
                al_chance=k / d_in,
                n_samples=int(n_samples),
            )
        )
    return out
