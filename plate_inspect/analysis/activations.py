"""Input moments of a torch model's linear layers, gathered by forward pre-hooks, and their alignment records.

Activations are never stored: a hook adds X^T X (float64) of each target layer's input, batch by batch, so any
model and any number of inputs fit in d_in x d_in per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Sized
from typing import Any

import torch
from torch import nn

from plate_inspect.analysis.alignment_math import ActivationMoments, AlignmentRecord, alignment_from_moments
from plate_inspect.arguments import iterable_argument, positive_int, positive_ints, seed_argument
from plate_inspect.errors import AlignmentError, ConfigError
from plate_inspect.progress import ProgressCallback, ProgressCounter
from plate_inspect.targets import (
    _LANGUAGE_MODEL,
    _NEVER_BY_DEFAULT,
    FAMILY_TARGETS,
    ROUTER,
    _in_other_tower,
    _matches,
    layer_of,
    model_family,
    module_type_of,
    mtp_layers,
    name_list,
)
from plate_inspect.train.layer import model_argument


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """W as [d_out, d_in] for nn.Linear and transformers' Conv1D (stored [d_in, d_out]); None otherwise."""
    if isinstance(module, nn.Linear):
        return module.weight
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        return weight.T
    return None


def _selected_weight(name: str, module: nn.Module) -> torch.Tensor:
    """W of a layer :func:`select_linear_modules` chose (it chose it because it has one)."""
    weight = linear_weight(module)
    assert weight is not None, f"{name} is not a linear layer"
    return weight


def select_linear_modules(model: nn.Module, target_modules: str | Sequence[str] | None = None) -> dict[str, nn.Module]:
    """Target linear layers by name (suffixes or regexes, as in ``scan``); default: those ``scan`` chooses
    (:func:`default_module_names`).

    One string is one pattern (not a sequence of one-character patterns: ``"10"`` would select layers 1 and 0)."""
    model_argument(model, "select_linear_modules")
    if target_modules is not None:
        names = name_list(target_modules) if isinstance(target_modules, (str, Iterable)) else None
        if names is None or not all(isinstance(t, str) for t in names):
            raise ConfigError(
                f"target_modules must be a list of module names or patterns (or one), got {target_modules!r:.80}"
            )
        target_modules = names
    linears = {n: m for n, m in model.named_modules() if n and linear_weight(m) is not None}
    if target_modules:
        chosen = {n: m for n, m in linears.items() if any(_matches(n, p) for p in target_modules)}
    else:
        chosen = {n: linears[n] for n in default_module_names(list(linears), _config_dict(model))}
    if not chosen:
        raise AlignmentError(
            "no target linear layers matched"
            + (f" {list(target_modules)}" if target_modules else "")
            + f"; linear layers in this model: {', '.join(list(linears)[:20]) or 'none'}"
        )
    return chosen


def _config_dict(model: nn.Module) -> dict[str, Any]:
    """The model's config as config.json holds it (a transformers config's ``to_dict()``; {} without one)."""
    config = getattr(model, "config", None)
    if isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    model_type = getattr(config, "model_type", None)
    return {"model_type": model_type} if isinstance(model_type, str) else {}


def default_module_names(names: Sequence[str], config: dict[str, Any]) -> list[str]:
    """The linear layers (by module name) a scan of this model chooses by default, as ``scan`` does on its
    checkpoint: the family's module types (:func:`model_family`: a multimodal wrapper's language model) in the
    numbered layers, a vision or audio tower's layers left out, multi-token-prediction layers skipped; a family
    the table does not know: every layer in the numbered layers but embeddings, norms, heads and routers.

    Llama-style names also match a CLIP vision tower's (``vision_tower...layers.0.self_attn.q_proj``): without the
    family rule an analysis of LLaVA or Qwen2-VL measured the vision tower too, modules its bundle does not hold."""
    family = model_family(config)
    if family in FAMILY_TARGETS:
        wanted = set(FAMILY_TARGETS[family])
        chosen = [n for n in names if module_type_of(n) in wanted and layer_of(n) is not None]
        if any(_in_other_tower(n) for n in chosen) or (
            isinstance(config.get("text_config"), dict) and any(p in n for n in chosen for p in _LANGUAGE_MODEL)
        ):
            chosen = [n for n in chosen if not _in_other_tower(n)]
            chosen = [n for n in chosen if any(p in n for p in _LANGUAGE_MODEL)] or chosen
    else:
        chosen = [n for n in names if not _NEVER_BY_DEFAULT.search(n) and not ROUTER.search(n)]
        if any(layer_of(n) is not None for n in chosen):  # heads and projectors sit outside the numbered layers
            chosen = [n for n in chosen if layer_of(n) is not None]
    mtp = mtp_layers(config)
    return [n for n in chosen if layer_of(n) not in mtp] if mtp else chosen


def _call(model: nn.Module, item: Any) -> Any:
    """One forward pass on one input: ``model(**item)`` for a dict, ``model(*item)`` for a tuple/list."""
    if isinstance(item, dict):
        return model(**item)
    if isinstance(item, (tuple, list)):
        return model(*item)
    return model(item)


def collect_input_moments(
    model: nn.Module,
    inputs: Iterable[Any],
    target_modules: str | Sequence[str] | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, ActivationMoments]:
    """Run ``model`` on every input and accumulate X^T X of each target layer's input (streamed, float64).

    An input is passed as ``model(**item)`` for a dict, ``model(*item)`` for a tuple/list, else ``model(item)``;
    ``forward(model, item)`` overrides that. Every leading dimension of a layer input counts as a sample row.
    ``progress`` gets one event per forward pass (unit "batches"; total known when ``inputs`` has a length).
    """
    model_argument(model, "collect_input_moments")
    iterable_argument(inputs, "inputs", "model inputs (a list of batches, a DataLoader)")
    modules = select_linear_modules(model, target_modules)
    moments: dict[str, ActivationMoments] = {}
    handles = []

    def make_hook(name: str, d_in: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_mod: nn.Module, args: tuple[Any, ...]) -> None:
            if args[0].shape[-1] != d_in:  # else a RuntimeError from reshape: "shape '[-1, 64]' is invalid"
                raise AlignmentError(
                    f"{name}: its input has {args[0].shape[-1]} features in the last dimension, the layer takes "
                    f"{d_in}: the inputs do not fit this model (check their shape)"
                )
            x = args[0].detach().reshape(-1, d_in).to(torch.float64)
            m = moments.get(name)
            if m is None:
                moments[name] = ActivationMoments(x.T @ x, x.shape[0])
            else:
                m.xtx += x.T @ x
                m.n += x.shape[0]

        return hook

    for name, mod in modules.items():
        d_in = _selected_weight(name, mod).shape[1]
        handles.append(mod.register_forward_pre_hook(make_hook(name, d_in)))
    was_training = model.training
    model.eval()
    counter = ProgressCounter(progress, len(inputs) if isinstance(inputs, Sized) else None, "batches")
    counter.start()
    try:
        with torch.no_grad():
            for i, item in enumerate(inputs):
                out = forward(model, item) if forward is not None else _call(model, item)
                del out
                counter.step(f"batch {i + 1}")
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n in modules if n not in moments]
    if missing:
        raise AlignmentError(
            f"these layers saw no input: {missing[:5]}{' ...' if len(missing) > 5 else ''} (the inputs were empty, or "
            "their forward never runs: e.g. torch's nn.MultiheadAttention applies out_proj's weight directly); "
            "leave them out with target_modules (CLI: --target-modules)"
        )
    return {n: moments[n] for n in modules}


def weight_activation_alignment(
    model: nn.Module,
    inputs: Iterable[Any],
    ks: Sequence[int] = (8, 32),
    target_modules: str | Sequence[str] | None = None,
    n_random: int = 8,
    seed: int = 0,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> list[AlignmentRecord]:
    """VE_k / AL_k records for every target linear layer of any torch model, fed an iterable of inputs."""
    model_argument(model, "weight_activation_alignment")
    iterable_argument(inputs, "inputs", "model inputs (a list of batches, a DataLoader)")
    n_random, seed = positive_int(n_random, "n_random"), seed_argument(seed)
    ks = check_ks(ks, select_linear_modules(model, target_modules))
    moments = collect_input_moments(model, inputs, target_modules, forward=forward)
    return records_from_moments(model, moments, ks, n_random, seed)


def records_from_moments(
    model: nn.Module, moments: dict[str, ActivationMoments], ks: Sequence[int], n_random: int, seed: int
) -> list[AlignmentRecord]:
    """VE_k / AL_k records of each layer whose input moments were collected, for the k values its shape allows."""
    modules = dict(model.named_modules())
    records: list[AlignmentRecord] = []
    for name, m in moments.items():
        weight = _selected_weight(name, modules[name])
        usable = [k for k in ks if k <= min(weight.shape)]
        records.extend(alignment_from_moments(name, weight, m.sigma, usable, n_random, seed, n_samples=m.n))
    return records


def check_ks(ks: Sequence[int], modules: dict[str, nn.Module] | None = None) -> list[int]:
    """Positive k values, each at most min(d_out, d_in) of every target layer (W's rank bound; when the layers are
    known): beyond it W's top-k right singular directions are arbitrary."""
    ks = positive_ints(ks, "ks")
    if modules:
        sides = {name: min(_selected_weight(name, m).shape) for name, m in modules.items()}
        smallest = min(sides.values())
        if max(ks) > smallest:
            narrow = [n for n, d in sides.items() if d < max(ks)]
            raise ConfigError(
                f"k={max(ks)} exceeds min(d_out, d_in)={smallest} of {len(narrow)} target layers (e.g. {narrow[0]}): "
                f"beyond W's rank its top-k directions are arbitrary; choose k <= {smallest} or narrow --target-modules"
            )
    return sorted(set(ks))
