"""Gradient checkpointing with PLATE layers: reentrant checkpointing after ``apply_bundle`` (no PeftModel), models
without input_ids, and the PEFT path's warnings against LoRA's (peft's own, none of ours)."""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path

import torch
from helpers_train import randomize_adapters

from plate_inspect import scan


def _switch_name(model) -> str:
    """transformers 5 names the checkpointing switch activation_*, 4.x gradient_*."""
    return "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"


def _checkpoint_reentrant(model, name: str | None = None, reentrant: bool = True) -> None:
    name = name or _switch_name(model)
    getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": reentrant}})


def _warnings_of(fn) -> list[str]:
    """Every warning ``fn`` emits (repeats too), as 'Category: message', sorted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return sorted(f"{w.category.__name__}: {w.message}" for w in caught)


def test_the_plate_peft_path_warns_exactly_as_lora_does(tiny_qwen, tmp_path):
    """Measured (peft 0.21.2, transformers 5.23): get_peft_model and PeftModel.from_pretrained warn "FutureWarning:
    `is_gradient_checkpointing` is deprecated" for LoRA as for PLATE: peft's PeftModel.__init__ reads the property.
    Our code adds no warning of any kind at any step (model creation, training step, checkpointing switch, save,
    load, merge), so it is left to peft (README: Supported versions)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from plate_inspect.train.peft import PlateConfig

    root, bundle = tiny_qwen
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def lifecycle(config, save: Path) -> list[list[str]]:
        steps, state = [], {}
        model = AutoModelForCausalLM.from_pretrained(root / "model")
        steps.append(_warnings_of(lambda: state.setdefault("pm", get_peft_model(model, config))))
        pm = state["pm"]
        steps.append(_warnings_of(lambda: pm(input_ids=ids, labels=ids).loss.backward()))
        # not reentrant: LoRA's PeftModel does not make the inputs require grad (4.x: no gradient to reach)
        steps.append(_warnings_of(lambda: _checkpoint_reentrant(pm, reentrant=False)))
        pm.train()
        steps.append(_warnings_of(lambda: pm(input_ids=ids, labels=ids).loss.backward()))
        steps.append(_warnings_of(lambda: pm.save_pretrained(save)))
        fresh = AutoModelForCausalLM.from_pretrained(root / "model")
        steps.append(_warnings_of(lambda: state.setdefault("loaded", PeftModel.from_pretrained(fresh, save))))
        steps.append(_warnings_of(lambda: state["loaded"].merge_and_unload()))
        return steps

    lora = lifecycle(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"), tmp_path / "l")
    plate = lifecycle(PlateConfig(bundle=str(bundle.path), task_type="CAUSAL_LM"), tmp_path / "p")
    assert plate == lora


def test_apply_bundle_then_reentrant_checkpointing_gives_a_the_plain_gradients(tiny_qwen):
    """use_reentrant=True (transformers 4.x's default) on a model whose only trainable tensors are apply_bundle's
    A's: switched on after apply_bundle (under either switch name transformers has) or before it, A gets the
    gradients of the same model run without checkpointing (to float32 rounding), and the decoder layers really
    ran twice. Before: "element 0 of tensors does not require grad" on transformers 4.x."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from plate_inspect.train.layer import apply_bundle

    root, bundle = tiny_qwen
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))

    def a_grads(mode: str) -> tuple[dict[str, torch.Tensor], int]:
        model = AutoModelForCausalLM.from_pretrained(root / "model")
        if mode == "before":
            _checkpoint_reentrant(model)
        params = apply_bundle(model, bundle)
        randomize_adapters(params, seed=4, scale=0.05)
        calls = []
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
        if mode in ("gradient", "activation"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # 5.x: gradient_* is deprecated
                _checkpoint_reentrant(model, mode)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for p in params), mode
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, len(calls)

    plain, plain_calls = a_grads("plain")
    assert len(plain) == 14 and plain_calls == 1 and all(g.abs().sum() > 0 for g in plain.values())
    five = hasattr(PreTrainedModel, "activation_checkpointing_enable")
    modes = ["before", "gradient"] + (["activation"] if five else [])
    for mode in modes:
        checkpointed, calls = a_grads(mode)
        assert calls == 2 and checkpointed.keys() == plain.keys(), mode
        for n, g in plain.items():  # 4.56.2 and 5.23: float32 rounding of the backward's sums at most
            assert (checkpointed[n] - g).abs().max() <= 2e-6 * g.abs().max(), (mode, n)


def _tiny_vit(root: Path):
    """A tiny ViTForImageClassification (takes pixel_values, not input_ids: transformers 5 does not make its
    embeddings require grad on its own), its weights saved under the model's own names, and its bundle."""
    from safetensors.torch import save_file
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=3,
    )
    model = ViTForImageClassification(config)
    (root / "vit").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "vit" / "model.safetensors")
    config.save_pretrained(root / "vit")
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [t for t in ("q_proj", "v_proj", "query", "value") if t in leaves]  # 5.x / 4.x names
    return model, scan(root / "vit", root / "vit-bundle", r=4, tau=0.8, max_rank=16, target_modules=targets)


def test_apply_bundle_checkpointing_trains_a_model_without_input_ids(tmp_path):
    """A ViT under reentrant checkpointing after apply_bundle: A's gradients equal the unchecked run's (before: no
    gradient at all, on transformers 5 too); a deep copy and a pickled copy make their own embeddings require
    grad, not the original's; unload gives back the model's own switch."""
    from plate_inspect.train.layer import CHECKPOINTING_ENABLE, apply_bundle, unload

    model, bundle = _tiny_vit(tmp_path)
    params = apply_bundle(model, bundle)
    randomize_adapters(params, seed=1, scale=0.05)
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 2])

    def grads(m) -> list[torch.Tensor]:
        m.train()
        m.zero_grad()
        m(pixel_values=pixels, labels=labels).loss.backward()
        trainable = [p for p in m.parameters() if p.requires_grad]
        assert len(trainable) == 4 and all(p.grad is not None for p in trainable)
        return [p.grad.clone() for p in trainable]

    plain = grads(copy.deepcopy(model))
    twin, pickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    for m in (twin, pickled):
        _checkpoint_reentrant(m)
        assert m.__dict__.get("_plate_input_grads") and not model.__dict__.get("_plate_input_grads")
        for got, want in zip(grads(m), plain, strict=True):
            assert got.abs().sum() > 0 and (got - want).abs().max() <= 2e-6 * want.abs().max()
    _checkpoint_reentrant(model)
    for got, want in zip(grads(model), plain, strict=True):
        assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    unload(model)
    assert not any(name in model.__dict__ for name in CHECKPOINTING_ENABLE)
