"""Stage-2 methods of the continual benchmark: how each one turns the stage-1 model into a trainable model.

Every method gets the stage-1 checkpoint and returns a :class:`Prepared` model whose trainable backbone parameters
(head 2 always trains and is not counted) and optional loss penalty define it. Names (``--methods``):

- ``full_ft``: every backbone parameter (fc1, fc2, fc3 weights and biases).
- ``l2_init``: ``full_ft`` + ``lam * sum ||theta - theta_1||^2`` over the backbone, theta_1 = the pre-task-2 weights
  (Kumar et al., "L2 Init"); the budget knob is ``lam`` (the trainable count is always 100%).
- ``lora``: PEFT LoRA on fc1/fc2/fc3, alpha/r = 0.5 (the paper's setting).
- ``o_lora``: ``lora`` + the O-LoRA orthogonality loss ``lam * sum_layers ||A_1 A_2^T||_F^2`` (Wang et al. 2023, eq. 6;
  lam = 0.5, their lambda_1; their L2 term lambda_2 = 0). O-LoRA needs the task-1 LoRA's A_1; stage 1 here trains
  the whole backbone from scratch, so A_1 is defined as the rank-r LoRA that best approximates task 1's update:
  the top-r right singular vectors (orthonormal rows) of W_1 - W_0 per layer, W_0 = the seed's initialisation.
- ``pissa``, ``mica``: PEFT LoRA with ``init_lora_weights="pissa"`` / ``"mica"`` (PEFT's own code; MiCA freezes B
  at the r left singular vectors of the smallest singular values, so only A (r x d_in) trains).
- ``osf``: PEFT ``OSFConfig`` with, per module, ``effective_rank = min(d_out, d_in) - n`` (``rank_pattern``): the
  bottom-n singular triplets train (U_low, S_low, V_low: n (d_out + d_in + 1) parameters), gradients projected
  orthogonal to the frozen top subspace.
- ``corda``: PEFT CorDA in knowledge-preserved mode (``init_lora_weights="corda"``, ``CordaConfig(corda_method=
  "kpm")``). **Data-using**: its covariance comes from the task-1 training inputs (a reference, not data-free).
- ``plate`` and the matched-capacity ablations ``plate_<variant>`` (:mod:`plate_inspect.train.variants`): the
  scanned bundle / variant bundle applied with :func:`plate_inspect.train.layer.apply_bundle`, rho = 0.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from plate_inspect.arguments import is_integer, real_value, text_argument
from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits
from plate_inspect.train.variants import VARIANTS

BACKBONE = digits.BACKBONE
LORA_ALPHA_PER_RANK = 0.5
OLORA_LAMBDA = 0.5
PLATE_RHO = 0.5
LORA_FAMILY = ("lora", "o_lora", "pissa", "mica", "corda")
METHODS = ("full_ft", "l2_init", *LORA_FAMILY, "osf", "plate", *(f"plate_{v}" for v in VARIANTS))
DATA_USING = frozenset({"corda"})  # methods whose init reads task-1 data (everything else is weight-only)


@dataclass(frozen=True)
class Budget:
    """One capacity (trainable-parameter budget) of a method: an id for tables and the config that sets it."""

    id: str
    config: dict[str, Any]


def method_argument(method: object) -> str:
    """``method`` when it is one of :data:`METHODS`, else the one ConfigError listing them (a non-string was an
    AttributeError from ``str.startswith``)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(f"unknown method {method!r:.80}; choose from {', '.join(METHODS)}")
    return method


def default_budgets(method: str) -> list[Budget]:
    """The capacity grid of each method (>= 3 per method, except full_ft which has one: all parameters)."""
    method = method_argument(method)
    if method == "full_ft":
        return [Budget("all", {})]
    if method == "l2_init":
        return [Budget(f"lam{lam:g}", {"lam": lam}) for lam in (0.01, 0.1, 1.0)]
    if method in LORA_FAMILY:
        return [Budget(f"r{r}", {"rank": r}) for r in (1, 8, 32)]
    if method == "osf":
        return [Budget(f"n{n}", {"n_low": n}) for n in (1, 8, 32)]
    if method == "plate":
        return [plate_budget(r, t) for r, t in ((8, 0.98), (32, 0.9), (32, 0.6), (128, 0.8))]
    return [plate_budget(r, t) for r, t in ((8, 0.98), (32, 0.9), (64, 0.8))]  # plate_<variant>: the ablations


def budget_keys(method: str) -> tuple[str, ...]:
    """The config keys a budget of ``method`` must set (what :func:`prepare` reads)."""
    method = method_argument(method)
    if method == "full_ft":
        return ()
    if method == "l2_init":
        return ("lam",)
    if method in LORA_FAMILY:
        return ("rank",)
    if method == "osf":
        return ("n_low",)
    return ("r", "tau")  # plate and its ablations


def budget_value_problem(key: str, value: object) -> str | None:
    """What a budget value must be when ``value`` is not that (None when it is fine): tau in (0, 1), lam a finite
    number >= 0, rank / n_low / r an integer >= 1."""
    number = real_value(value)  # NaN for a non-number, +-inf beyond float's range (10**400)
    if key == "tau":
        return None if 0 < number < 1 else "a number strictly between 0 and 1"
    if key == "lam":
        return None if math.isfinite(number) and number >= 0 else "a finite number >= 0"
    ok = is_integer(value) and number >= 1  # an int: its float (inf beyond range) compares as it does
    return None if ok else "an integer >= 1"


def check_budget(method: str, budget: Budget) -> None:
    """ConfigError, before anything trains, for a budget whose config lacks a key of ``method`` or sets an unknown one
    (a budget's config is only read when its run starts: a typo would otherwise fail after hours of other runs)."""
    want = budget_keys(method)
    config = budget.config if isinstance(budget, Budget) and isinstance(budget.config, dict) else None
    if config is None or set(config) != set(want):
        got = sorted(config) if config is not None else budget
        raise ConfigError(
            f"{method}: budget {getattr(budget, 'id', budget)!r} has config keys {got}; {method} needs exactly "
            f"{list(want)} (e.g. {default_budgets(method)[0]})"
        )
    for key, value in config.items():  # a run reads its budget only when it starts: check the values now too
        need = budget_value_problem(key, value)
        if need is not None:
            raise ConfigError(f"{method}: budget {budget.id!r}: {key} must be {need}, got {value!r:.80}")


def plate_budget(r: int, tau: float) -> Budget:
    """PLATE's budget point (r rows, energy threshold tau), named as the result tables name it."""
    for key, value in (("r", r), ("tau", tau)):
        need = budget_value_problem(key, value)
        if need is not None:
            raise ConfigError(f"plate_budget: {key} must be {need}, got {value!r:.80}")
    return Budget(f"r{r}_tau{tau:g}", {"r": r, "tau": tau})


def repeated_values(values: Any) -> list[str]:
    """The values that occur more than once, in order of their second occurrence."""
    seen: set[Any] = set()
    twice: list[str] = []
    for v in values:
        if v in seen and str(v) not in twice:
            twice.append(str(v))
        seen.add(v)
    return twice


def parse_methods(text: str, allowed: Sequence[str] = METHODS) -> list[str]:
    """'a,b,...' -> validated method names: ConfigError naming an unknown one (listing ``allowed``) or one listed
    twice (refused, as a repeated --steps value or seed is: one rule for every list option)."""
    text = text_argument(text, "methods (CLI: --methods)", ",".join(allowed[:2]))
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ConfigError(f"--methods is empty; give a comma-separated list, e.g. {','.join(allowed[:3])}")
    for m in names:
        if m not in allowed:
            raise ConfigError(f"unknown method '{m}' in --methods; choose from {', '.join(allowed)}")
    if repeated_values(names):
        raise ConfigError(f"--methods lists {', '.join(repeated_values(names))} twice; give each once")
    return names


@dataclass
class StageOne:
    """A seed's stage-1 result: checkpoint, task-1 data, W0, and lazily scanned bundles / variant bundles."""

    seed: int
    seed_dir: Path
    checkpoint: Path
    task1: digits.Task
    init_state: dict[str, torch.Tensor]
    max_rank: int = 256
    _bundles: dict[tuple[str, int, float], Path] = field(default_factory=dict)

    def bundle(self, r: int, tau: float, variant: str | None = None) -> Path:
        """The PLATE bundle (or its ``variant`` ablation) at (r, tau), scanned on first use."""
        key = (variant or "plate", r, tau)
        if key in self._bundles:
            return self._bundles[key]
        base = self.seed_dir / f"bundle_r{r}_tau{tau:g}"
        if ("plate", r, tau) not in self._bundles:
            from plate_inspect.scanner import scan

            scan(
                self.checkpoint,
                base,
                r=r,
                tau=tau,
                max_rank=self.max_rank,
                seed=self.seed,
                target_modules=list(BACKBONE),
                overwrite=True,
            )
            self._bundles[("plate", r, tau)] = base
        if variant is None:
            return base
        from plate_inspect.train.variants import make_variant

        out = self.seed_dir / f"variant_{variant}_r{r}_tau{tau:g}"
        make_variant(base, self.checkpoint, variant, out, seed=self.seed, overwrite=True)
        self._bundles[key] = out
        return out


@dataclass
class Prepared:
    """A model ready for stage 2: what to optimise (adapter + head 2), the counted budget, an optional penalty."""

    model: nn.Module
    params: list[nn.Parameter]
    trainable_params: int
    penalty: Callable[[], torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- penalties (pure functions)
def _total(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of scalar tensors, as ``sum`` adds them (left to right); a zero tensor for none (``sum`` gives int 0)."""
    total = None
    for term in terms:
        total = term if total is None else total + term
    return torch.zeros(()) if total is None else total


def l2_init_penalty(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], lam: float) -> torch.Tensor:
    """lam * sum_i ||params_i - anchors_i||_F^2 (L2 Init toward the pre-task-2 weights)."""
    return lam * _total(((p - a) ** 2).sum() for p, a in zip(params, anchors, strict=True))


def olora_penalty(
    old_a: Sequence[torch.Tensor], new_a: Sequence[torch.Tensor], lam: float = OLORA_LAMBDA
) -> torch.Tensor:
    """lam * sum_layers ||A_old A_new^T||_F^2 (O-LoRA's orthogonality loss; A is r x d_in, rows = input directions)."""
    return lam * _total(((a_old @ a_new.T) ** 2).sum() for a_old, a_new in zip(old_a, new_a, strict=True))


def task1_lora_basis(w1: torch.Tensor, w0: torch.Tensor, rank: int) -> torch.Tensor:
    """The task-1 LoRA's A for O-LoRA: top-``rank`` right singular vectors (rows, orthonormal) of W_1 - W_0."""
    _, _, vh = torch.linalg.svd((w1 - w0).double(), full_matrices=False)
    return vh[:rank].to(w1.dtype).contiguous()


# --------------------------------------------------------------------------- closed forms of the budgets
def lora_trainable(shapes: list[tuple[int, int]], rank: int) -> int:
    """LoRA / PiSSA / CorDA / O-LoRA: rank (d_in + d_out) per layer (A and B)."""
    return sum(rank * (d_in + d_out) for d_out, d_in in shapes)


def mica_trainable(shapes: list[tuple[int, int]], rank: int) -> int:
    """MiCA: only A trains: rank d_in per layer."""
    return sum(rank * d_in for _, d_in in shapes)


def osf_trainable(shapes: list[tuple[int, int]], n_low: int) -> int:
    """OSF: U_low (d_out x n), S_low (n), V_low (n x d_in) per layer."""
    return sum(n_low * (d_out + d_in + 1) for d_out, d_in in shapes)


def backbone_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(d_out, d_in) of each adapted backbone layer, in BACKBONE order."""
    return [tuple(getattr(model, m).weight.shape) for m in BACKBONE]


def backbone_params(model: nn.Module) -> int:
    """Parameters of fc1, fc2, fc3 (weights and biases)."""
    return sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] in BACKBONE)


# --------------------------------------------------------------------------- preparing one run
def _head2(model: nn.Module) -> list[nn.Parameter]:
    head = model.get_submodule("head2")
    for p in head.parameters():
        p.requires_grad_(True)
    return list(head.parameters())


def _peft_trainable(peft_model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in peft_model.named_parameters() if p.requires_grad and "head2" not in n]


def prepare(method: str, config: dict[str, Any], stage1: StageOne) -> Prepared:
    """The stage-1 model set up for ``method`` at the capacity ``config`` (a Budget's config)."""
    method = method_argument(method)
    model = digits.load_model(stage1.checkpoint)
    if method in ("full_ft", "l2_init"):
        params = [p for n, p in model.named_parameters() if n.split(".")[0] in BACKBONE]
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        penalty = None
        if method == "l2_init":
            anchors = [p.detach().clone() for p in params]
            lam = float(config["lam"])
            penalty = lambda: l2_init_penalty(params, anchors, lam)  # noqa: E731
        return Prepared(model, params + _head2(model), backbone_params(model), penalty)
    if method in LORA_FAMILY:
        return _prepare_lora(method, int(config["rank"]), model, stage1)
    if method == "osf":
        return _prepare_osf(int(config["n_low"]), model)
    if method == "plate" or method.startswith("plate_"):
        from plate_inspect.bundle import Bundle
        from plate_inspect.train.layer import apply_bundle

        variant = None if method == "plate" else method.removeprefix("plate_")
        path = stage1.bundle(int(config["r"]), float(config["tau"]), variant)
        adapter = apply_bundle(model, path, rho=PLATE_RHO)
        ks = {rec.name: rec.k for rec in Bundle.load(path)}
        cfg = {**config, "rho": PLATE_RHO, "k": ks, **({"variant": variant} if variant else {})}
        return Prepared(model, adapter + _head2(model), sum(p.numel() for p in adapter), None, cfg)
    raise AssertionError(f"prepare: no branch for method {method!r}")  # method_argument admits only METHODS


def _prepare_lora(method: str, rank: int, model: nn.Module, stage1: StageOne) -> Prepared:
    from peft import LoraConfig, get_peft_model

    max_rank = min(min(s) for s in backbone_shapes(model))
    if not 1 <= rank <= max_rank and method in ("pissa", "mica", "corda", "o_lora"):
        raise ConfigError(f"{method}: rank {rank} exceeds the smallest layer dimension {max_rank}")
    inits: dict[str, bool | Literal["pissa", "mica", "corda"]] = {
        "lora": True,
        "o_lora": True,
        "pissa": "pissa",
        "mica": "mica",
        "corda": "corda",
    }
    init = inits[method]
    kwargs: dict[str, Any] = {}
    if method == "corda":
        from peft.tuners.lora.config import CordaConfig

        kwargs["corda_config"] = CordaConfig(corda_method="kpm")
    cfg = LoraConfig(
        r=rank,
        lora_alpha=LORA_ALPHA_PER_RANK * rank,  # type: ignore[arg-type]  # peft says int; its scaling is alpha / r
        lora_dropout=0.0,
        target_modules=list(BACKBONE),
        init_lora_weights=init,
        **kwargs,
    )
    config: dict[str, Any] = {"rank": rank, "alpha": LORA_ALPHA_PER_RANK * rank}
    if method == "corda":
        from peft.tuners.lora.corda import preprocess_corda

        x1 = stage1.task1.x_train
        preprocess_corda(model, cfg, run_model=lambda: model(x1, task=1))
        config["data_using"] = "task-1 training inputs (CorDA KPM covariance)"
    w0 = {m: stage1.init_state[f"{m}.weight"] for m in BACKBONE}
    w1 = {m: getattr(model, m).weight.detach().clone() for m in BACKBONE}
    peft_model = get_peft_model(model, cfg)
    adapter = _peft_trainable(peft_model)
    penalty = None
    if method == "o_lora":
        old = [task1_lora_basis(w1[m], w0[m], rank) for m in BACKBONE]
        new = [_lora_a(peft_model, m).weight for m in BACKBONE]
        penalty = lambda: olora_penalty(old, new, OLORA_LAMBDA)  # noqa: E731
        config["lambda"] = OLORA_LAMBDA
    return Prepared(peft_model, adapter + _head2(model), sum(p.numel() for p in adapter), penalty, config)


def _lora_a(peft_model: nn.Module, module: str) -> nn.Linear:
    """The default adapter's LoRA A layer on backbone ``module`` of a PeftModel."""
    lora_a = peft_model.get_submodule(f"base_model.model.{module}.lora_A.default")
    assert isinstance(lora_a, nn.Linear), f"{module}: LoRA A is a {type(lora_a).__name__}"
    return lora_a


def _prepare_osf(n_low: int, model: nn.Module) -> Prepared:
    from peft import OSFConfig, get_peft_model

    shapes = dict(zip(BACKBONE, backbone_shapes(model), strict=True))
    pattern: dict[str, int | float] = {}  # peft's type: a rank, or a fraction of the layer's
    for m, (d_out, d_in) in shapes.items():
        if not 1 <= n_low < min(d_out, d_in):
            raise ConfigError(f"osf: n_low {n_low} must be in 1..{min(d_out, d_in) - 1} for {m} {d_out}x{d_in}")
        pattern[f"^{m}$"] = min(d_out, d_in) - n_low
    cfg = OSFConfig(target_modules=list(BACKBONE), rank_pattern=pattern, effective_rank=1)
    peft_model = get_peft_model(model, cfg)
    adapter = _peft_trainable(peft_model)
    config = {"n_low": n_low, "effective_rank": {m: min(s) - n_low for m, s in shapes.items()}}
    return Prepared(peft_model, adapter + _head2(model), sum(p.numel() for p in adapter), None, config)
