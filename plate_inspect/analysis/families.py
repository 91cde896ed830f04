"""Update families S: linear subspaces of parameter space with an isometric parametrisation ``c -> v = M c``.

M has orthonormal columns (``||v|| = ||c||``) and is never formed: each :class:`Block` maps its slice of the
coordinates to one parameter's delta (``embed``) and back by the adjoint (``project``). The restricted curvature
operators (:mod:`plate_inspect.analysis.operators`) are ``M^T C M`` on these coordinates, so a unit coordinate
vector is a unit update, as the paper's lambda(S) and eps(S) (sup over unit v in S) need.

Families: every coordinate of some parameters (the full backbone), a LoRA rank-r tangent space at a random init,
the PLATE subspace B A Q^T from a bundle, and the paper's matched-capacity ablations of it (:data:`PLATE_VARIANTS`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plate_inspect.analysis.old_task import Params
from plate_inspect.arguments import positive_int, seed_argument
from plate_inspect.errors import ConfigError, CurvatureError
from plate_inspect.geometry import module_seed
from plate_inspect.targets import name_list
from plate_inspect.train.layer import model_argument
from plate_inspect.train.variants import variant_geometry

if TYPE_CHECKING:
    from plate_inspect.bundle import Bundle

#: Names of the PLATE-family variants accepted by :func:`plate_family` (the paper's matched-capacity ablations).
PLATE_VARIANTS = ("plate", "random_b", "random_q", "high_energy_q", "least_redundant_b", "random_bq")


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
        """dim(S): the number of coordinates."""
        return sum(b.dim for b in self.blocks)

    @property
    def params(self) -> list[str]:
        """The names of the parameters the family moves."""
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


def _identity_block(name: str, p: torch.Tensor) -> Block:
    """Every coordinate of parameter ``p``: the delta is the coordinates reshaped."""
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
    """A CurvatureError naming the parameters of ``chosen`` the model lacks."""
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
