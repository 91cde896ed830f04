"""Old-task curvature and functional drift restricted to an update family S (paper sections 2-3 and appendices
"Empirical diagnostic of the Gauss-Newton decomposition" and "Worst-case forgetting complementary experiment").

An update family is a linear subspace S of parameter space given by an isometric parametrisation
``c in R^m -> v = M c`` (M has orthonormal columns, so ||v|| = ||c||). Curvature is exposed as matrix-free
operators on the coordinates c, wrapped as :class:`scipy.sparse.linalg.LinearOperator` (one abstraction, in the
style of curvlinops):

- ``H_S  = M^T H0 M`` with H0 the Hessian of the old-task loss L0 (Hessian-vector products by double backward);
- ``GN_S = M^T J^T (d^2 loss / df^2) J M`` (Gauss-Newton: a jvp, the loss Hessian in output space, a vjp);
- ``D_S  = M^T E_x[J(x)^T J(x)] M`` (the drift Gram: ``c^T D_S c = ||J v||^2_{L2(P0)}``).

From them: lambda(S) = max eigenvalue of H_S and eps(S) = sqrt(max eigenvalue of D_S) by Lanczos
(:func:`scipy.sparse.linalg.eigsh`) on operators of dimension dim(S), never on dense model-size matrices; the
directional decomposition q_H, q_GN, q_R = q_H - q_GN over random unit probes; the forgetting curve
F(rho) = L0(theta0 + rho v*) - L0(theta0) along the top-curvature direction v*; and the bound of Proposition
"restricted curvature is bounded by functional drift", lambda(S) <= beta eps(S)^2 with beta the largest
eigenvalue of the per-sample loss Hessian in output space.

Families: the full backbone, a LoRA rank-r tangent space at a random init, the PLATE subspace B A Q^T from a bundle,
and the matched-capacity ablations Random-B, Random-Q and High-energy-Q.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh
from torch import nn
from torch.func import functional_call, grad, jvp, vjp

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch 2.2: math_attention falls back to torch.backends.cuda.sdp_kernel
    SDPBackend = sdpa_kernel = None  # type: ignore[misc, assignment]  # (torch 2.2 has neither; checked before use)

from plate_inspect.arguments import (
    finite_numbers,
    iterable_argument,
    non_negative_int,
    non_negative_number,
    positive_int,
    seed_argument,
)
from plate_inspect.atomic import make_dirs
from plate_inspect.errors import ConfigError, CurvatureError
from plate_inspect.geometry import module_seed
from plate_inspect.progress import ProgressCallback, ProgressCounter
from plate_inspect.targets import name_list
from plate_inspect.train.layer import model_argument
from plate_inspect.train.variants import variant_geometry

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle
    from plate_inspect.experiments.digits import Task

Params = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Default step sizes for the forgetting curve F(rho).
DEFAULT_RHOS: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)
#: Families with at most this many coordinates are eigendecomposed densely (exact) instead of by Lanczos.
DENSE_MAX_DIM = 64
#: eigsh's relative tolerance for the top eigenvalues (analyze_family(tol=) overrides it).
LANCZOS_TOL = 1e-6
#: Names of the PLATE-family variants accepted by :func:`plate_family` (the paper's matched-capacity ablations).
PLATE_VARIANTS = ("plate", "random_b", "random_q", "high_energy_q", "least_redundant_b", "random_bq")


# --------------------------------------------------------------------------- update families
@dataclass
class Block:
    """The part of a family that moves one parameter tensor: coordinates slice <-> parameter delta."""

    param: str
    dim: int
    embed: Callable[[torch.Tensor], torch.Tensor]  # [dim] -> delta with the parameter's shape
    project: Callable[[torch.Tensor], torch.Tensor]  # delta -> [dim]; the adjoint of embed


@dataclass
class UpdateFamily:
    """A linear update subspace S with an isometric parametrisation (orthonormal basis, never formed densely)."""

    name: str
    blocks: list[Block]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return sum(b.dim for b in self.blocks)

    @property
    def params(self) -> list[str]:
        return [b.param for b in self.blocks]

    def embed(self, c: torch.Tensor) -> Params:
        """Coordinates [dim] -> a parameter delta per touched parameter (v = M c)."""
        if c.shape != (self.dim,):
            raise CurvatureError(f"family {self.name}: expected coordinates of shape [{self.dim}], got {list(c.shape)}")
        out: Params = {}
        i = 0
        for b in self.blocks:
            out[b.param] = b.embed(c[i : i + b.dim])
            i += b.dim
        return out

    def project(self, delta: Params) -> torch.Tensor:
        """A parameter-space vector (dict) -> coordinates (c = M^T v)."""
        return torch.cat([b.project(delta[b.param]).reshape(-1) for b in self.blocks])


def _vjp(fn: Callable[..., Any], primals: Any) -> tuple[Any, Callable[..., Any]]:
    """torch.func.vjp without aux: (output, pullback) (its stub's return type also allows has_aux's triple)."""
    out = vjp(fn, primals)
    return out[0], out[1]


def _identity_block(name: str, p: torch.Tensor) -> Block:
    shape = tuple(p.shape)
    return Block(name, p.numel(), lambda c: c.reshape(shape), lambda d: d.reshape(-1))


def full_family(model: nn.Module, params: Sequence[str] | None = None, name: str = "full") -> UpdateFamily:
    """Every coordinate of the named parameters (default: all parameters that require grad)."""
    named = dict(model_argument(model, "full_family").named_parameters())
    chosen = _names(params, "params") if params is not None else [n for n, p in named.items() if p.requires_grad]
    _check_params(named, chosen)
    return UpdateFamily(name, [_identity_block(n, named[n].detach()) for n in chosen], {"params": chosen})


def _names(names: object, argument: str) -> list[str]:
    """Parameter or module names as a list (one string is one name); else a ConfigError naming ``argument``."""
    listed = name_list(names) if isinstance(names, (str, Iterable)) else None
    if listed is None or not all(isinstance(n, str) for n in listed):
        raise ConfigError(f"{argument} must be a list of names (or one name), got {names!r:.80}")
    return listed


def _check_params(named: dict[str, Any], chosen: Iterable[str]) -> None:
    missing = [n for n in chosen if n not in named]
    if missing:
        raise CurvatureError(f"parameters not in the model: {missing}; it has {list(named)[:20]}")


def selector_basis_block(param: str, shape: tuple[int, int], b_idx: torch.Tensor, q: torch.Tensor) -> Block:
    """Delta W = B A Q^T with A [r, k] free: rows b_idx of W move inside span(Q). Isometric for orthonormal Q."""
    d_out, d_in = shape
    b_idx = b_idx.to(torch.int64)
    r, k = int(b_idx.numel()), int(q.shape[1])
    if q.shape[0] != d_in:
        raise CurvatureError(f"{param}: Q has {q.shape[0]} rows, the weight has d_in={d_in}")
    if r and (int(b_idx.max()) >= d_out or int(b_idx.min()) < 0):
        raise CurvatureError(f"{param}: B indices out of range for d_out={d_out}")

    def embed(c: torch.Tensor) -> torch.Tensor:
        qq = q.to(c.dtype)
        delta = torch.zeros(d_out, d_in, dtype=c.dtype)
        return delta.index_put((b_idx,), c.reshape(r, k) @ qq.T)

    def project(d: torch.Tensor) -> torch.Tensor:
        return (d[b_idx] @ q.to(d.dtype)).reshape(-1)

    return Block(param, r * k, embed, project)


def lora_tangent_block(param: str, shape: tuple[int, int], rank: int, seed: int, zero_b: bool = False) -> Block:
    """Tangent space of W + B A at a random init (B0 [d_out, r], A0 [r, d_in] Gaussian), isometrically.

    At B0 != 0 the tangent directions dB A0 + B0 dA span {U X + U_perp Y V^T} (U, V: orthonormal bases of the
    column space of B0 and the row space of A0), dimension r (d_in + d_out) - r^2. With ``zero_b`` (PEFT's
    default init, B0 = 0) only dB A0 moves: {Y V^T}, dimension d_out r.
    """
    d_out, d_in = shape
    if not 1 <= rank <= min(d_out, d_in):
        raise ConfigError(f"{param}: LoRA rank {rank} must lie in 1..min(d_out, d_in)={min(d_out, d_in)}")
    g = torch.Generator().manual_seed(int(seed))
    a0 = torch.randn(rank, d_in, generator=g, dtype=torch.float64)
    b0 = torch.randn(d_out, rank, generator=g, dtype=torch.float64)
    v = torch.linalg.qr(a0.T).Q  # [d_in, r]
    if zero_b:

        def embed0(c: torch.Tensor) -> torch.Tensor:
            return c.reshape(d_out, rank) @ v.to(c.dtype).T

        def project0(d: torch.Tensor) -> torch.Tensor:
            return (d @ v.to(d.dtype)).reshape(-1)

        return Block(param, d_out * rank, embed0, project0)
    full_q = torch.linalg.qr(b0, mode="complete").Q  # [d_out, d_out]
    u, u_perp = full_q[:, :rank].contiguous(), full_q[:, rank:].contiguous()
    n_x, n_y = rank * d_in, (d_out - rank) * rank

    def embed(c: torch.Tensor) -> torch.Tensor:
        x, y = c[:n_x].reshape(rank, d_in), c[n_x:].reshape(d_out - rank, rank)
        return u.to(c.dtype) @ x + u_perp.to(c.dtype) @ (y @ v.to(c.dtype).T)

    def project(d: torch.Tensor) -> torch.Tensor:
        x = u.to(d.dtype).T @ d
        y = u_perp.to(d.dtype).T @ d @ v.to(d.dtype)
        return torch.cat([x.reshape(-1), y.reshape(-1)])

    return Block(param, n_x + n_y, embed, project)


def lora_family(
    model: nn.Module, modules: Sequence[str], rank: int, seed: int = 0, zero_b: bool = False
) -> UpdateFamily:
    """LoRA rank-r tangent subspace on the weights of ``modules`` (module names, e.g. ['fc1', 'fc2']).

    B0 / A0 are [d_out, r] / [r, d_in] of the oriented weight, also for a transformers ``Conv1D`` (stored
    [d_in, d_out]): with ``zero_b`` the update's input side stays in row(A0), as in PEFT's LoRA."""
    from plate_inspect.train.layer import layout_of

    named = dict(model_argument(model, "lora_family").named_parameters())
    rank, seed = positive_int(rank, "rank"), seed_argument(seed)
    blocks = []
    for m in _names(modules, "modules"):
        pname = f"{m}.weight"
        _check_params(named, [pname])
        conv1d = layout_of(model.get_submodule(m)) == "conv1d"
        rows, cols = named[pname].shape  # 2-D: layout_of refused any other layer
        shape = (cols, rows) if conv1d else (rows, cols)
        block = lora_tangent_block(pname, shape, rank, module_seed(seed, m), zero_b=zero_b)
        blocks.append(_transposed(block) if conv1d else block)
    return UpdateFamily(f"lora_r{rank}", blocks, {"rank": rank, "zero_b": zero_b})


def plate_family(
    model: nn.Module,
    bundle: Bundle | str | os.PathLike,
    variant: str = "plate",
    seed: int = 0,
    modules: Sequence[str] | None = None,
    check_weights: bool = True,
) -> UpdateFamily:
    """The PLATE subspace {B A Q^T} of every bundle module (or a matched-capacity ablation of it).

    ``variant``: ``plate`` (the bundle's B and Q), ``random_b`` (r uniformly random rows, same Q), ``random_q``
    (a Haar-random orthonormal k-frame, same B), ``high_energy_q`` (the top-k eigenvectors of the frozen rows'
    W_f^T W_f, same B), ``least_redundant_b`` (the r least redundant rows, same Q) or ``random_bq`` (both random).
    Module names are the bundle's; a module is an ``nn.Linear`` or a transformers ``Conv1D`` (whose stored
    [d_in, d_out] weight moves by the transposed delta). ``check_weights``: refuse (BundleError) a module whose
    weights are not the ones the bundle was made for (the fingerprint check of ``apply_bundle``): a bundle of
    another model with the same shapes would otherwise give a silently meaningless family.
    """
    from plate_inspect.train.layer import _as_bundle, check_module_against_record, layout_of

    model_argument(model, "plate_family")
    bundle = _as_bundle(bundle)  # a Bundle or its directory, as apply_bundle takes it
    seed = seed_argument(seed)
    if variant not in PLATE_VARIANTS:
        raise ConfigError(f"unknown PLATE variant '{variant}'; choose one of {', '.join(PLATE_VARIANTS)}")
    named = dict(model.named_parameters())
    blocks = []
    for m in _names(modules, "modules") if modules is not None else bundle.modules:
        pname = f"{m}.weight"
        _check_params(named, [pname])
        module, record = model.get_submodule(m), bundle.record(m)
        if check_weights:
            check_module_against_record(module, m, record, bundle=bundle)
        layout = layout_of(module)
        w = named[pname].detach().to("cpu", torch.float64)
        w = w.T if layout == "conv1d" else w
        if tuple(w.shape) != tuple(record.shape):
            raise CurvatureError(f"{m}: bundle made for shape {record.shape}, the model's weight is {list(w.shape)}")
        d_out, d_in = w.shape
        b_idx, q = bundle.b_idx(m), bundle.q(m, dtype=torch.float64)
        if variant != "plate":
            b_idx, q = variant_geometry(variant, w, b_idx, q, bundle.redundancy(m), module_seed(seed, m))
        block = selector_basis_block(pname, (d_out, d_in), b_idx, q)
        blocks.append(_transposed(block) if layout == "conv1d" else block)
    return UpdateFamily(variant, blocks, {"variant": variant})


def _transposed(block: Block) -> Block:
    """The same subspace for a parameter stored transposed (Conv1D's [d_in, d_out]): still isometric."""
    return Block(block.param, block.dim, lambda c: block.embed(c).T, lambda d: block.project(d.T))


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
    ):
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

    def __init__(self, model: nn.Module, state: Params):
        super().__init__()
        self._model, self._state = model, state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self._model, self._state, args, kwargs)


# --------------------------------------------------------------------------- restricted operators
def restricted_operator(problem: OldTaskProblem, family: UpdateFamily, kind: str = "hessian") -> LinearOperator:
    """M^T C M as a scipy LinearOperator on the family's coordinates; kind: hessian | ggn | drift."""
    products = {"hessian": problem.hvp, "ggn": problem.ggn_vp, "drift": problem.drift_vp}
    if kind not in products:
        raise ConfigError(f"unknown curvature kind '{kind}'; choose hessian, ggn or drift")
    product = products[kind]
    dtype = next(iter(problem.theta0.values())).dtype

    def matvec(c: np.ndarray) -> np.ndarray:
        ct = torch.from_numpy(np.ascontiguousarray(c, dtype=np.float64).reshape(-1)).to(dtype)
        with torch.no_grad():
            v = family.embed(ct)
        out = product(v)
        with torch.no_grad():
            return family.project(out).to(torch.float64).numpy()

    return LinearOperator((family.dim, family.dim), matvec=matvec, rmatvec=matvec, dtype=np.float64)


def counted_operator(op: LinearOperator, on_product: Callable[[int], None]) -> LinearOperator:
    """``op`` calling ``on_product(n)`` after its n-th application (a solve's progress: Lanczos takes an unknown
    number of products, each a pass over the old-task data)."""
    n = 0

    def matvec(c: np.ndarray) -> np.ndarray:
        nonlocal n
        out = op.matvec(c)
        n += 1
        on_product(n)
        return out

    return LinearOperator(op.shape, matvec=matvec, rmatvec=matvec, dtype=op.dtype)


def top_eigenpair(
    op: LinearOperator,
    seed: int = 0,
    tol: float = LANCZOS_TOL,
    dense_max_dim: int = DENSE_MAX_DIM,
    maxiter: int | None = None,
) -> tuple[float, np.ndarray]:
    """(largest algebraic eigenvalue, unit eigenvector) of a symmetric operator: Lanczos, or dense when tiny.

    Lanczos that does not converge within ``maxiter`` restarts (default max(1000, 20 min(dim, 500))) is a
    CurvatureError, never an unconverged value."""
    m = op.shape[0]
    if m <= dense_max_dim:
        dense = np.column_stack([op.matvec(e) for e in np.eye(m)])
        evals, evecs = np.linalg.eigh(0.5 * (dense + dense.T))
        return float(evals[-1]), evecs[:, -1]
    v0 = np.random.default_rng(seed).standard_normal(m)
    maxiter = max(1000, 20 * min(m, 500)) if maxiter is None else int(maxiter)
    try:
        evals, evecs = eigsh(op, k=1, which="LA", v0=v0, tol=tol, maxiter=maxiter)
    except ArpackNoConvergence:
        raise CurvatureError(
            f"Lanczos (eigsh) found no top eigenvalue of the {m}-dimensional restricted operator within {maxiter} "
            f"iterations at tol={tol:g}; loosen tol (analyze_family(..., tol=)) or give maxiter"
        ) from None
    return float(evals[0]), evecs[:, 0]


# --------------------------------------------------------------------------- the analysis
@dataclass
class CurvatureRecord:
    """Restricted curvature, drift radius, GN decomposition and forgetting curve of one family."""

    family: str
    dim: int
    lam: float  # lambda(S) = max_{v in S, |v|=1} v^T H0 v
    eps: float  # eps(S) = max_{v in S, |v|=1} ||J v||_{L2(P0)}
    gn_share_median: float  # median |q_GN| / |q_H| over probes
    residual_ratio_median: float  # median |q_R| / |q_GN| over probes
    forgetting_curve: list[tuple[float, float]]  # (rho, L0(theta0 + rho v*) - L0(theta0))
    lam_gn: float = float("nan")  # max eigenvalue of the restricted GGN (always <= beta eps^2)
    beta: float = float("nan")  # max eigenvalue of the per-sample output-space loss Hessian
    n_probes: int = 0
    q_h: list[float] = field(default_factory=list, repr=False)
    q_gn: list[float] = field(default_factory=list, repr=False)

    @property
    def bound(self) -> float:
        """beta eps(S)^2, the paper's bound on lambda(S) when the residual term is negligible."""
        return self.beta * self.eps**2

    @property
    def bound_ratio(self) -> float:
        """lambda(S) / (beta eps(S)^2): <= 1 where the bound holds; how far it is from holding otherwise."""
        return self.lam / self.bound if self.bound > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` record: the issue's keys, then the bound check (beta, lambda_gn, bound, bound_ratio).

        Strict JSON: an undefined value (a median over no probes, a ratio to a zero bound) is None, never NaN/inf,
        which ``json.dumps`` would write as the non-JSON tokens ``NaN`` / ``Infinity``."""
        return _finite_or_none(
            {
                "family": self.family,
                "dim": self.dim,
                "lambda": self.lam,
                "eps": self.eps,
                "gn_share_median": self.gn_share_median,
                "residual_ratio_median": self.residual_ratio_median,
                "forgetting_curve": [[float(r), float(f)] for r, f in self.forgetting_curve],
                "beta": self.beta,
                "lambda_gn": self.lam_gn,
                "bound": self.bound,
                "bound_ratio": self.bound_ratio,
            }
        )


def _finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts and lists, recursively) replaced by None."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def random_unit_probes(dim: int, n: int, seed: int) -> Iterator[np.ndarray]:
    """n unit vectors uniform on the sphere of R^dim (seeded), one at a time: the same vectors as the rows of one
    (n, dim) draw, without holding n x dim numbers (--probes 10^5 on the full backbone, dim 148,224: 119 GB)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        g = rng.standard_normal(dim)
        yield g / np.linalg.norm(g)


def gn_decomposition(
    problem: OldTaskProblem,
    family: UpdateFamily,
    n_probes: int = 100,
    seed: int = 0,
    counter: ProgressCounter | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q_H, q_GN, drift^2) for n random unit directions of the family; ``counter`` steps once per probe."""
    dtype = next(iter(problem.theta0.values())).dtype
    q_h, q_gn, drift = [], [], []
    for i, c in enumerate(random_unit_probes(family.dim, n_probes, seed)):
        with torch.no_grad():
            v = family.embed(torch.from_numpy(c).to(dtype))
        a, b, d = problem.quadratic_forms(v)
        q_h.append(a)
        q_gn.append(b)
        drift.append(d)
        if counter is not None:
            counter.step(f"{family.name}: probe {i + 1}/{n_probes}")
    return np.array(q_h), np.array(q_gn), np.array(drift)


def _median_ratio(num: np.ndarray, den: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.abs(num) / np.abs(den)
    return float(np.median(r)) if r.size else float("nan")


def forgetting_curve(
    problem: OldTaskProblem, direction: Params, rhos: Sequence[float] = DEFAULT_RHOS
) -> list[tuple[float, float]]:
    """F(rho) = L0(theta0 + rho v) - L0(theta0) for each rho."""
    rhos = finite_numbers(rhos, "rhos", empty=True)
    base = problem.loss()
    return [(float(r), problem.loss({n: r * d for n, d in direction.items()}) - base) for r in rhos]


_SOLVES = (("hessian", "top Hessian eigenvalue"), ("ggn", "top GGN eigenvalue"), ("drift", "drift radius"))


def family_parts(n_probes: int) -> int:
    """The progress units of one family: three top-eigenvalue solves (Hessian, GGN, drift), one per GN probe and
    one for the forgetting curve (Lanczos takes an unknown number of products, so a solve is one unit; within it
    the progress label counts its products: :meth:`ProgressCounter.within`)."""
    return len(_SOLVES) + n_probes + 1


def analyze_family(
    problem: OldTaskProblem,
    family: UpdateFamily,
    n_probes: int = 100,
    rhos: Sequence[float] = DEFAULT_RHOS,
    seed: int = 0,
    beta: float | None = None,
    tol: float = LANCZOS_TOL,
    progress: ProgressCallback | None = None,
) -> CurvatureRecord:
    """lambda(S), eps(S), the restricted GGN's top eigenvalue, GN-share medians and F(rho) for one family.

    The top-curvature direction v* is signed so that g0 . v* >= 0 (the worse of +-v*, as g0 is rarely exactly 0).
    ``progress`` gets :func:`family_parts` events (unit "parts": a solve, a probe, the curve)."""
    if not isinstance(problem, OldTaskProblem):
        raise ConfigError(f"problem must be an OldTaskProblem(model, loss_fn, data), got {problem!r:.80}")
    n_probes, rhos, seed = _check_settings(family, n_probes, rhos, seed, "family")
    if beta is not None:
        beta = non_negative_number(beta, "beta")
    tol = non_negative_number(tol, "tol")
    counter = ProgressCounter(progress, family_parts(n_probes), "parts")
    counter.start()
    return _analyze_family(problem, family, n_probes, rhos, seed, beta, tol, counter)


def _analyze_family(
    problem: OldTaskProblem,
    family: UpdateFamily,
    n_probes: int,
    rhos: Sequence[float],
    seed: int,
    beta: float | None,
    tol: float,
    counter: ProgressCounter,
) -> CurvatureRecord:
    """:func:`analyze_family`, stepping ``counter`` after each of its :func:`family_parts` parts."""
    if family.dim < 1:
        raise CurvatureError(f"family {family.name} is empty")
    beta = problem.output_hessian_bound() if beta is None else float(beta)
    top = {}
    for i, (kind, what) in enumerate(_SOLVES):

        def product(n: int, what: str = what) -> None:
            counter.within(lambda: f"{family.name}: {what}, product {n}")

        op = counted_operator(restricted_operator(problem, family, kind), product)
        top[kind] = top_eigenpair(op, seed=seed + i, tol=tol)
        counter.step(f"{family.name}: {what}")
    (lam, c_star), (lam_gn, _), (eps_sq, _) = top["hessian"], top["ggn"], top["drift"]
    dtype = next(iter(problem.theta0.values())).dtype
    with torch.no_grad():
        v_star = family.embed(torch.from_numpy(np.ascontiguousarray(c_star)).to(dtype))
    g0 = problem.gradient(v_star)
    if sum(float((g0[n] * v_star[n]).sum()) for n in v_star) < 0:
        v_star = {n: -d for n, d in v_star.items()}
    q_h, q_gn, _ = gn_decomposition(problem, family, n_probes=n_probes, seed=seed + 3, counter=counter)
    curve = forgetting_curve(problem, v_star, rhos)
    counter.step(f"{family.name}: forgetting curve")
    return CurvatureRecord(
        family=family.name,
        dim=family.dim,
        lam=lam,
        eps=math.sqrt(max(eps_sq, 0.0)),
        gn_share_median=_median_ratio(q_gn, q_h),
        residual_ratio_median=_median_ratio(q_h - q_gn, q_gn),
        forgetting_curve=curve,
        lam_gn=lam_gn,
        beta=beta,
        n_probes=int(n_probes),
        q_h=[float(a) for a in q_h],
        q_gn=[float(b) for b in q_gn],
    )


def _check_settings(
    family: object, n_probes: object, rhos: object, seed: object, argument: str = "families"
) -> tuple[int, list[float], int]:
    """(n_probes, rhos, seed) checked: n_probes >= 0 (0: no GN probes, the medians are undefined), finite rhos
    (none: no forgetting curve), a seed numpy and torch take (0..2^63-1); ``family`` an UpdateFamily. ConfigError
    naming the argument otherwise."""
    if not isinstance(family, UpdateFamily):
        raise ConfigError(
            f"{argument}: each must be an UpdateFamily (from full_family, lora_family or plate_family), "
            f"got {family!r:.80}"
        )
    return non_negative_int(n_probes, "n_probes"), finite_numbers(rhos, "rhos", empty=True), seed_argument(seed)


def analyze_families(
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable[tuple[Any, torch.Tensor]],
    families: Sequence[UpdateFamily],
    n_probes: int = 100,
    rhos: Sequence[float] = DEFAULT_RHOS,
    seed: int = 0,
    forward: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    progress: ProgressCallback | None = None,
) -> list[CurvatureRecord]:
    """The Python API: one :class:`CurvatureRecord` per family for any model, loss and old-task data loader.

    ``progress`` gets :func:`family_parts` events per family (unit "parts": each top-eigenvalue solve, GN probe and
    forgetting curve), so the bar moves within a large family too."""
    model_argument(model, "analyze_families")
    if isinstance(families, (UpdateFamily, str)) or not isinstance(families, Sequence) or not families:
        raise ConfigError(f"families must be a non-empty list of UpdateFamily objects, got {families!r:.80}")
    for fam in families:
        n_probes, rhos, seed = _check_settings(fam, n_probes, rhos, seed)
    counter = ProgressCounter(progress, len(families) * family_parts(n_probes), "parts")
    counter.start()
    was_training = model.training
    try:
        problem = OldTaskProblem(model, loss_fn, data, forward=forward)
        beta = problem.output_hessian_bound()
        out = []
        for fam in families:
            out.append(_analyze_family(problem, fam, n_probes, rhos, seed, beta, LANCZOS_TOL, counter))
    finally:
        model.train(was_training)
    return out


# --------------------------------------------------------------------------- the digits benchmark
@dataclass
class DigitsSetup:
    """Stage 1 of the digits benchmark: the trained model, its checkpoint, its bundle and task 1 data."""

    model: nn.Module
    checkpoint: Path
    bundle: Bundle
    task1: Task
    task1_test_accuracy: float


#: The stage-1 checkpoint digits_stage1 saves in its output directory (its own: a rerun may replace it).
STAGE1_CHECKPOINT = "digits_task1.safetensors"


def digits_stage1(
    out_dir: str | os.PathLike,
    epochs: int = 30,
    seed: int = 0,
    r: int = 8,
    tau: float = 0.98,
    max_rank: int = 256,
    progress: ProgressCallback | None = None,
) -> DigitsSetup:
    """Train the digits MLP on task 1, save it as safetensors, scan fc1/fc2/fc3 into a PLATE bundle.

    The scan settings are checked first: a bad ``tau`` is refused before the training, not after it. ``progress``
    gets one event per Adam step of the training (unit "steps"; the scan of three modules is instant)."""
    from plate_inspect.experiments import digits
    from plate_inspect.experiments.continual import check_own_directory
    from plate_inspect.geometry import validate_settings
    from plate_inspect.scanner import scan

    validate_settings(r=r, tau=tau, max_rank=max_rank)
    check_own_directory(out_dir, ours=(STAGE1_CHECKPOINT,))  # not a model's or a bundle's directory

    out_dir = make_dirs(out_dir, "the output directory")
    task1, _ = digits.load_digit_tasks()
    model = digits.train_stage1(task1, seed=seed, epochs=epochs, progress=progress)
    ckpt = out_dir / STAGE1_CHECKPOINT
    digits.save_model(model, ckpt)
    bundle = scan(
        ckpt, out_dir / "bundle", r=r, tau=tau, max_rank=max_rank, target_modules=list(digits.BACKBONE), overwrite=True
    )
    acc = digits.accuracy(model, task1.x_test, task1.y_test, task_id=1)
    return DigitsSetup(model, ckpt, bundle, task1, acc)


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of (x, y) minibatches in order (a re-iterable old-task data loader)."""
    batch_size = positive_int(batch_size, "batch_size")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape[:1] != y.shape[:1]:
        raise ConfigError(
            "x and y must be tensors with one row each per sample, got "
            f"{getattr(x, 'shape', type(x).__name__)} and {getattr(y, 'shape', type(y).__name__)}"
        )
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)]
