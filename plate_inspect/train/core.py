"""The PLATE branch core: y = base(x) + rho * scatter_B((x Q) A^T), shared by ``PlateLinear`` and the PEFT layer.

One module holds everything both wrappers need: validation of B (an int64 index of r distinct output rows) and Q
([d_in, k], frozen), the forward of the adapter branch (a custom autograd function that picks the cheaper evaluation
order per call), the dense update rho B A Q^T, and merge/unmerge of that update into a base weight in its stored
layout (``[d_out, d_in]`` for nn.Linear, ``[d_in, d_out]`` for GPT-2 Conv1D).

Evaluation orders of the branch (n rows of x, d_in inputs, k = Q's columns, r = B's rows):

- ``xq``: Z = x Q, then Z A^T: n*d_in*k + n*k*r multiply-adds (cheap when n is small against k);
- ``m``: M = A Q^T once per call, then x M^T: r*k*d_in + n*d_in*r (cheap when n is large: LoRA-like).

The backward picks independently: grad A = Z^T g (``z``: Z saved or recomputed) or (g^T x) Q (``gx``); grad x =
(g A) Q^T (``a``) or g M (``m``). Q never receives a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from plate_inspect.arguments import real_value
from plate_inspect.bundle import geometry_digest as geometry_digest  # re-exported: trainers digest B/Q with it
from plate_inspect.errors import BundleError, ConfigError


def check_rho(rho: object) -> float:
    """rho as a float; ConfigError unless it is a real number, finite and > 0 (shared by every PLATE entry point)."""
    value = real_value(rho)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"rho must be a positive finite number (the update's scale, e.g. 0.5), got {rho!r:.80}")
    return value


# --------------------------------------------------------------------------- geometry
def validate_geometry(
    b_idx: torch.Tensor, q: torch.Tensor, d_out: int, d_in: int, where: str = "layer"
) -> tuple[torch.Tensor, torch.Tensor]:
    """B as a flat int64 index of distinct rows in 0..d_out-1 and Q as a 2-D floating [d_in, k]; else BundleError."""
    b = torch.as_tensor(b_idx).detach()
    if b.is_floating_point() or b.dtype == torch.bool:
        raise BundleError(f"{where}: B must be an integer index of output rows, got dtype {b.dtype}")
    b = b.to(torch.int64).flatten()
    if not isinstance(q, torch.Tensor):  # a NumPy array: 'ndarray' object has no attribute 'is_floating_point'
        raise ConfigError(f"{where}: Q must be a torch tensor [d_in, k], got {type(q).__name__}")
    if q.ndim != 2 or q.shape[0] != d_in:
        raise BundleError(f"{where}: Q has shape {list(q.shape)} but the layer has d_in={d_in} (Q must be [d_in, k])")
    if not q.is_floating_point():
        raise BundleError(f"{where}: Q must be a floating tensor, got dtype {q.dtype}")
    if not bool(torch.isfinite(q).all()):  # a NaN in Q makes every output of the layer NaN once A moves
        raise BundleError(f"{where}: Q holds NaN or Inf entries; the bundle is corrupt (verify it, rescan)")
    if b.numel() and (int(b.min()) < 0 or int(b.max()) >= d_out):
        raise BundleError(f"{where}: B indexes rows outside 0..{d_out - 1}; the bundle belongs to another model")
    if torch.unique(b).numel() != b.numel():
        raise BundleError(f"{where}: B has repeated rows; the bundle is corrupt (rescan it)")
    return b, q.detach()


# --------------------------------------------------------------------------- evaluation orders
@dataclass(frozen=True)
class BranchOrder:
    """How one call evaluates the branch: forward ``xq``|``m``, grad A ``z``|``gx``, grad x ``a``|``m``."""

    forward: str
    grad_a: str
    grad_x: str


ALL_ORDERS = tuple(BranchOrder(f, ga, gx) for f in ("xq", "m") for ga in ("z", "gx") for gx in ("a", "m"))


def branch_costs(order: BranchOrder, n: int, d_in: int, k: int, r: int, need_grad_x: bool = True) -> int:
    """Multiply-adds of forward + backward for one call in the given order (what ``choose_order`` minimises)."""
    cost = n * d_in * k + n * k * r if order.forward == "xq" else r * k * d_in + n * d_in * r
    if order.grad_a == "z":
        cost += n * k * r + (0 if order.forward == "xq" else n * d_in * k)
    else:
        cost += r * n * d_in + r * d_in * k
    if need_grad_x:
        if order.grad_x == "a":
            cost += n * r * k + n * k * d_in
        else:
            cost += n * r * d_in + (0 if order.forward == "m" else r * k * d_in)
    return cost


def choose_order(n: int, d_in: int, k: int, r: int, need_grad_x: bool = True) -> BranchOrder:
    """The cheapest evaluation order for these sizes (ties: fewer saved activations, i.e. ``m`` forward)."""
    best, best_cost = ALL_ORDERS[-1], branch_costs(ALL_ORDERS[-1], n, d_in, k, r, need_grad_x)
    for order in ALL_ORDERS[-2::-1]:  # a plain loop (torch.compile traces it; min(key=...) it does not)
        cost = branch_costs(order, n, d_in, k, r, need_grad_x)
        if cost < best_cost:
            best, best_cost = order, cost
    return best


class _PlateBranch(torch.autograd.Function):
    """rho * x Q A^T as [n, r] with a per-call evaluation order; no gradient to Q, rho or the order.

    Written in the ``setup_context`` form with ``generate_vmap_rule``, so torch.func's reverse-mode transforms work
    on PLATE layers as on plain ones (per-sample gradients by ``vmap(grad(...))``, ``jacrev``): the old
    ``forward(ctx, ...)`` form refused every one of them. No ``jvp`` (forward mode): torch.compile cannot trace
    a Function that defines one. The intermediate a backward needs (Z = x Q or M = A Q^T)
    is a second, non-differentiable output so that ``setup_context`` can save it (an empty tensor when the order
    needs none); callers use the first output.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # x2 [n, d_in], q [d_in, k], a [r, k], all in the compute dtype
        x2: torch.Tensor, q: torch.Tensor, a: torch.Tensor, rho: float, order: BranchOrder
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if order.forward == "xq":
            z = x2 @ q
            out = z @ a.t()
            kept = z if order.grad_a == "z" else z.new_zeros(0)
        else:
            m = a @ q.t()
            out = x2 @ m.t()
            kept = m if order.grad_x == "m" else m.new_zeros(0)
        if rho != 1.0:
            out = out * rho
        return out, kept

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        x2, q, a, rho, order = inputs
        kept = output[1]
        ctx.mark_non_differentiable(kept)
        ctx.rho, ctx.order = rho, order
        keep_z = kept if (order.forward == "xq" and order.grad_a == "z") else None
        keep_m = kept if (order.forward == "m" and order.grad_x == "m") else None
        ctx.save_for_backward(x2, q, a, keep_z, keep_m)

    @staticmethod
    def backward(
        ctx: Any, g: torch.Tensor, _g_kept: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None, None]:
        x2, q, a, z, m = ctx.saved_tensors
        order, rho = ctx.order, ctx.rho
        if rho != 1.0:
            g = g * rho
        grad_x = grad_a = None
        if ctx.needs_input_grad[2]:
            if order.grad_a == "z":
                zz = z if z is not None else x2 @ q
                grad_a = g.t() @ zz
            else:
                grad_a = (g.t() @ x2) @ q
        if ctx.needs_input_grad[0]:
            if order.grad_x == "a":
                grad_x = (g @ a) @ q.t()
            else:
                mm = m if m is not None else a @ q.t()
                grad_x = g @ mm
        return grad_x, None, grad_a, None, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the adapter branch runs in: the autocast dtype when autocast is on, else the input's dtype."""
    dev = x.device.type
    if dev in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def branch_delta(
    x: torch.Tensor, q: torch.Tensor, a: torch.Tensor, rho: float, order: BranchOrder | None = None
) -> torch.Tensor:
    """rho * (x Q) A^T with shape [..., r], in the input's (or autocast's) dtype, cheapest order unless given."""
    dt = compute_dtype(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(dt)
    n, d_in = x2.shape
    r, k = a.shape
    if order is None:
        order = choose_order(n, d_in, k, r, need_grad_x=x.requires_grad)
    with torch.autocast(x.device.type, enabled=False):
        out = _PlateBranch.apply(x2, q.to(dt), a.to(dt), float(rho), order)[0]
    return out.reshape(*lead, r)


def add_branch(
    y: torch.Tensor,
    x: torch.Tensor,
    b_idx: torch.Tensor,
    q: torch.Tensor,
    a: torch.Tensor,
    rho: float,
    order: BranchOrder | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """y with rho (x Q) A^T added into its output features B (index_add over r rows, never a dense d_out x r map).

    ``inplace=True`` adds into ``y`` itself (for a base output that no backward needs, e.g. nn.Linear's).
    """
    if b_idx.numel() == 0:
        return y
    delta = branch_delta(x, q, a, rho, order).to(y.dtype)
    return y.index_add_(-1, b_idx, delta) if inplace else y.index_add(-1, b_idx, delta)


# --------------------------------------------------------------------------- dense update, merge, unmerge
def delta_rows(a: torch.Tensor, q: torch.Tensor, rho: float) -> torch.Tensor:
    """rho A Q^T in float32 or wider: the change of the r selected rows of W ([r, d_in])."""
    dt = torch.promote_types(torch.promote_types(a.dtype, q.dtype), torch.float32)
    return rho * (a.detach().to(dt) @ q.detach().to(dt).t())


def dense_delta(
    b_idx: torch.Tensor, a: torch.Tensor, q: torch.Tensor, rho: float, d_out: int, layout: str = "linear"
) -> torch.Tensor:
    """The dense update rho B A Q^T in the weight's stored layout (for checks, peft and small layers only)."""
    d = delta_rows(a, q, rho)
    full = torch.zeros(d_out, d.shape[1], dtype=d.dtype, device=d.device)
    full[b_idx] = d
    return full.t() if layout == "conv1d" else full


@torch.no_grad()
def merge_rows(
    weight: torch.Tensor, layout: str, b_idx: torch.Tensor, a: torch.Tensor, q: torch.Tensor, rho: float
) -> torch.Tensor:
    """W[B] += rho A Q^T in place (float32, rounded once to W's dtype); returns the replaced rows."""
    d = delta_rows(a, q, rho).to(weight.device)
    if layout == "conv1d":
        old = weight[:, b_idx].clone()
        new = (old.to(d.dtype) + d.t()).to(weight.dtype)
        weight[:, b_idx] = new
    else:
        old = weight[b_idx].clone()
        new = (old.to(d.dtype) + d).to(weight.dtype)
        weight[b_idx] = new
    return old


@torch.no_grad()
def unmerge_rows(weight: torch.Tensor, layout: str, b_idx: torch.Tensor, saved: torch.Tensor) -> None:
    """Put back the rows ``merge_rows`` replaced: the weight is bit-identical to before the merge.

    The rows stay as they were at merge time; a model cast or moved since (``merge_adapter()``, ``.to(bf16)``,
    ``unmerge_adapter()``) gets them cast and moved as its weight was: the cast of the unmerged weight, exactly.
    """
    saved = saved.to(weight.device, weight.dtype)
    if layout == "conv1d":
        weight[:, b_idx] = saved
    else:
        weight[b_idx] = saved


def merged_copy(
    stored: torch.Tensor, layout: str, b_idx: torch.Tensor, a: torch.Tensor, q: torch.Tensor, rho: float
) -> torch.Tensor:
    """A merged copy of a stored weight (the checkpoint merger's form of ``merge_rows``)."""
    w = stored.clone()
    merge_rows(w, layout, b_idx, a, q, rho)
    return w.contiguous()
