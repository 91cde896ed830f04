"""The old-task loss L0 and its matrix-free derivatives at theta0 (paper: L0, g0, H0, J and the Gauss-Newton
decomposition of H0 in the proof of Proposition "restricted curvature is bounded by functional drift").

``L0(theta) = E_{(x, y) ~ P0} loss(f_theta(x), y)``, estimated as the mean over the old-task samples; a sample is
one leading row of a batch (a sequence, for a model whose outputs are [B, T, ...]). :class:`OldTaskProblem` gives
L0, g0 and the products ``H0 v`` (double backward), ``E[J^T (d2 loss / df2) J] v`` (the Gauss-Newton part) and
``E[J^T J] v`` (the drift Gram), and beta, the largest eigenvalue of the per-sample loss Hessian in output space.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch 2.2: math_attention falls back to torch.backends.cuda.sdp_kernel
    SDPBackend = sdpa_kernel = None  # type: ignore[misc, assignment]  # (torch 2.2 has neither; checked before use)

from plate_inspect.arguments import iterable_argument, positive_int
from plate_inspect.errors import ConfigError, CurvatureError
from plate_inspect.train.layer import model_argument

#: A parameter-space vector: a delta (or a product) per named parameter, in the parameter's shape.
Params = dict[str, torch.Tensor]
#: ``loss_fn(outputs, targets)``, averaging over the batch (like ``F.cross_entropy``).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _vjp(fn: Callable[..., Any], primals: Any) -> tuple[Any, Callable[..., Any]]:
    """torch.func.vjp without aux: (output, pullback) (its stub's return type also allows has_aux's triple)."""
    out = vjp(fn, primals)
    return out[0], out[1]


# --------------------------------------------------------------------------- old-task loss and its derivatives
def math_attention() -> contextlib.AbstractContextManager[None]:
    """scaled_dot_product_attention restricted to its math kernel, on torch 2.2 too (pyproject's floor is 2.5).

    The fused kernels (flash, memory-efficient) have no double backward and no forward-mode derivative. torch >= 2.3
    spells the restriction ``torch.nn.attention.sdpa_kernel``; torch 2.2 only has ``torch.backends.cuda.sdp_kernel``
    (its flags choose the CPU kernel too).
    """
    if sdpa_kernel is None:
        return torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False)
    return sdpa_kernel(SDPBackend.MATH)


#: Parameter dtypes too coarse for second-order products (8 and 11 significant bits).
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class OldTaskProblem:
    """L0(theta) = mean over P0 of loss(f_theta(x), y), with matrix-free derivatives at theta0.

    ``data`` is a re-iterable of (x, y) batches (a list or a DataLoader); ``loss_fn(outputs, targets)`` must
    average over the batch (like ``F.cross_entropy``), so batch b enters with weight n_b / N.
    ``forward(model, x)`` overrides ``model(x)``. The model is put in eval mode (no dropout: L0 is deterministic);
    :func:`analyze_families` restores the mode it found.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        data: Iterable[tuple[Any, torch.Tensor]],
        forward: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    ) -> None:
        model_argument(model, "OldTaskProblem")
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn must be a function loss_fn(outputs, targets), got {loss_fn!r:.80}")
        if forward is not None and not callable(forward):
            raise ConfigError(f"forward must be a function forward(model, x) or None, got {forward!r:.80}")
        iterable_argument(data, "data", "(x, y) batches (a list or a DataLoader)")
        low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.dtype in _LOW_PRECISION})
        if low:
            raise ConfigError(
                f"the model holds {'/'.join(low)} parameters: curvature products in them keep ~2-3 significant "
                "digits (and q_R = q_H - q_GN, a difference of near-equal numbers, fewer); analyse a float32 or "
                "float64 copy (copy.deepcopy(model).float())"
            )
        self.model = model
        self.loss_fn = loss_fn
        self.batches = list(data)
        if not self.batches:
            raise CurvatureError("the old-task data is empty")
        for i, batch in enumerate(self.batches):
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor)):
                raise ConfigError(
                    f"data must hold (x, y) batches with y a tensor of targets; batch {i} is {type(batch).__name__}"
                    + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                    + " (curvature.batches(x, y) makes them)"
                )
        self.sizes = [int(y.shape[0]) for _, y in self.batches]
        self.n = sum(self.sizes)
        self.forward = forward
        self.theta0: Params = {n: p.detach() for n, p in model.named_parameters()}
        self.buffers: Params = {n: b.detach() for n, b in model.named_buffers()}
        model.eval()

    # ----------------------------------------------------------------- plumbing
    def _f(self, sub: Params, x: Any) -> torch.Tensor:
        """f_theta(x) with the parameters in ``sub`` replaced (the others at theta0): the function torch.func
        differentiates."""
        state = {**self.theta0, **self.buffers, **sub}
        # scaled_dot_product_attention's fused kernels (flash, memory-efficient) have no double backward and no
        # forward-mode derivative: Hessian-vector products through attention need the plain math kernel
        with math_attention():
            if self.forward is None:
                return functional_call(self.model, state, (x,))
            return self.forward(_Bound(self.model, state), x)

    def _primals(self, names: Iterable[str]) -> Params:
        return {n: self.theta0[n] for n in names}

    def _weights(self) -> list[float]:
        """n_b / N per batch: batch means weighted into the mean over all samples."""
        return [s / self.n for s in self.sizes]

    # ----------------------------------------------------------------- values
    def loss(self, delta: Params | None = None) -> float:
        """L0(theta0 + delta)."""
        delta = delta or {}
        sub = {n: self.theta0[n] + d.to(self.theta0[n].dtype) for n, d in delta.items()}
        total = 0.0
        with torch.no_grad():
            for (x, y), w in zip(self.batches, self._weights(), strict=True):
                total += w * float(self.loss_fn(self._f(sub, x), y))
        return total

    def gradient(self, names: Iterable[str]) -> Params:
        """g0 = grad L0(theta0) for the named parameters."""
        primals = self._primals(names)
        out = {n: torch.zeros_like(p) for n, p in primals.items()}
        for (x, y), w in zip(self.batches, self._weights(), strict=True):
            g = grad(lambda p, x=x, y=y: self.loss_fn(self._f(p, x), y))(primals)
            for n in out:
                out[n] += w * g[n]
        return out

    # ----------------------------------------------------------------- products
    def hvp(self, v: Params) -> Params:
        """H0 v (a Hessian-vector product by double backward), for a delta on some parameters."""
        primals, tangents = self._primals(v), self._tangents(v)
        out = {n: torch.zeros_like(p) for n, p in primals.items()}
        for (x, y), w in zip(self.batches, self._weights(), strict=True):
            g = grad(lambda p, x=x, y=y: self.loss_fn(self._f(p, x), y))
            # reverse-over-reverse (H is symmetric, so the vjp of the gradient is H v); forward-over-reverse
            # trips over torch's immutable ZeroTensors when a layer's second derivative vanishes (linear models)
            _, pull = _vjp(g, primals)
            (hv,) = pull(tangents)
            for n in out:
                out[n] += w * hv[n]
        return out

    def _tangents(self, v: Params) -> Params:
        return {n: d.to(self.theta0[n].dtype) for n, d in v.items()}

    def _jvp(self, v: Params, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(x), J(x) v) at theta0: one forward-mode pass."""
        out = jvp(lambda p: self._f(p, x), (self._primals(v),), (self._tangents(v),))
        return out[0], out[1]  # (its stub also allows has_aux's triple)

    def _loss_hvp_out(self, out: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """(d^2 loss / df^2) u at the batch outputs."""

        def loss_at(o: torch.Tensor) -> torch.Tensor:
            return self.loss_fn(o, y)

        _, pull = _vjp(grad(loss_at), out)  # symmetric: the vjp is the product
        (hu,) = pull(u)
        return hu

    def ggn_vp(self, v: Params) -> Params:
        """J^T (d^2 loss / df^2) J v, averaged over P0 (the Gauss-Newton part of H0)."""
        primals = self._primals(v)
        res = {n: torch.zeros_like(p) for n, p in primals.items()}
        for (x, y), w in zip(self.batches, self._weights(), strict=True):
            out, jv = self._jvp(v, x)
            hjv = self._loss_hvp_out(out.detach(), y, jv)
            _, pull = _vjp(partial(self._f, x=x), primals)
            (g,) = pull(hjv)
            for n in res:
                res[n] += w * g[n]
        return res

    def drift_vp(self, v: Params) -> Params:
        """E_x[J(x)^T J(x)] v (so that v^T of it is ||J v||^2_{L2(P0)})."""
        primals = self._primals(v)
        res = {n: torch.zeros_like(p) for n, p in primals.items()}
        for x, _ in self.batches:
            _, jv = self._jvp(v, x)
            _, pull = _vjp(partial(self._f, x=x), primals)
            (g,) = pull(jv / self.n)
            for n in res:
                res[n] += g[n]
        return res

    def quadratic_forms(self, v: Params) -> tuple[float, float, float]:
        """(q_H, q_GN, ||J v||^2_{L2(P0)}) for one direction v."""
        hv = self.hvp(v)
        q_h = sum(float((hv[n] * self._tangents(v)[n]).sum()) for n in v)
        q_gn, drift = 0.0, 0.0
        for (x, y), w in zip(self.batches, self._weights(), strict=True):
            out, jv = self._jvp(v, x)
            q_gn += w * float((jv * self._loss_hvp_out(out.detach(), y, jv)).sum())
            drift += float((jv * jv).sum()) / self.n
        return q_h, q_gn, drift

    def output_hessian_bound(self) -> float:
        """beta = max over samples of the largest eigenvalue of the per-sample loss Hessian in output space."""
        beta = -math.inf
        for x, y in self.batches:
            with torch.no_grad():
                out = self._f({}, x).detach()
            flat = out.reshape(out.shape[0], -1)
            shape = out.shape[1:]

            def per_sample(o: torch.Tensor, t: torch.Tensor, shape: torch.Size = shape) -> torch.Tensor:
                return self.loss_fn(o.reshape(1, *shape), t.unsqueeze(0))

            try:
                hess = torch.vmap(torch.func.hessian(per_sample))(flat, y)
            except Exception:  # a loss that vmap cannot batch: one sample at a time
                hess = torch.stack([torch.func.hessian(per_sample)(flat[i], y[i]) for i in range(flat.shape[0])])
            hess = 0.5 * (hess + hess.transpose(1, 2))
            beta = max(beta, float(torch.linalg.eigvalsh(hess.to(torch.float64)).max()))
        return beta


class _Bound(nn.Module):
    """What a user ``forward(model, x)`` receives: calling it runs the model with the parameters replaced."""

    def __init__(self, model: nn.Module, state: Params) -> None:
        super().__init__()
        self._model, self._state = model, state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self._model, self._state, args, kwargs)


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of (x, y) minibatches in order (a re-iterable old-task data loader)."""
    batch_size = positive_int(batch_size, "batch_size")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape[:1] != y.shape[:1]:
        raise ConfigError(
            "x and y must be tensors with one row each per sample, got "
            f"{getattr(x, 'shape', type(x).__name__)} and {getattr(y, 'shape', type(y).__name__)}"
        )
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)]
