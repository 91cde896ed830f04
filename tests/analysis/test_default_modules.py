"""The analyses' default target layers are the scan's: on a multimodal wrapper (LLaVA, Qwen2-VL, Idefics3, ...) the
language model's projections, not the vision tower's, whose CLIP/SigLIP layers carry the same Llama-style names
(``...encoder.layers.0.self_attn.q_proj``).

Oracle: the modules ``scan`` chooses on the checkpoint transformers' own ``save_pretrained`` wrote for the same tiny
model, read back as matrices. Compared by value (random bf16 weights: each matrix is unique), since transformers 5
saves some wrappers under their older names (LLaVA's ``language_model.model.layers...`` for the model's
``model.language_model.layers...``). Experts the model holds fused as one 3-D parameter are no Linear layer, so an
activation analysis cannot hook them: the scan's per-expert modules are the only ones it may lack."""

from __future__ import annotations

import copy

import pytest
import torch
from checkpoint.test_modern_families import WRAPPERS
from oracles import matrix_key

import plate_inspect
from plate_inspect.analysis.activations import linear_weight, select_linear_modules
from plate_inspect.analysis.alignment import default_module_names, weight_activation_alignment
from plate_inspect.checkpoint import Checkpoint
from plate_inspect.targets import EXPERT_LAYOUTS, load_target, modules_by_name, select_targets

#: Every wrapper, and causal families whose layers differ in kind (hybrid linear attention, Mamba, MoE with dense first
#: layers, fused QKV, parallel attention) or whose names are not Llama's.
FAMILIES = (*WRAPPERS, "qwen3_next", "granitemoehybrid", "glm4_moe", "phi", "falcon", "gpt_neox", "jamba", "minimax")


def scanned_matrices(path, names=None) -> tuple[set[tuple], set[tuple]]:
    """(matrices of the scan's modules, those of them that are experts), read from the checkpoint; ``names``: the
    modules of a bundle (default: those select_targets chooses)."""
    ckpt = Checkpoint.open(path)
    targets = select_targets(ckpt)[0] if names is None else [modules_by_name(ckpt)[n] for n in names]
    read = {t.name: matrix_key(load_target(ckpt, t)[0]) for t in targets}
    assert len(set(read.values())) == len(read)
    experts = {read[t.name] for t in targets if t.expert is not None or t.layout in EXPERT_LAYOUTS}
    return set(read.values()), experts


@pytest.mark.parametrize("family", FAMILIES)
def test_analysis_defaults_are_the_scans_modules(saved_tiny_model, family):
    model, path = saved_tiny_model(family)
    chosen = select_linear_modules(model)
    mine = [matrix_key(linear_weight(m)) for m in chosen.values()]
    assert len(set(mine)) == len(mine)
    scanned, experts = scanned_matrices(path)
    linear = {matrix_key(linear_weight(m)) for _, m in model.named_modules() if linear_weight(m) is not None}
    assert set(mine) == scanned & linear, "the analysis chose other layers than the scan"
    assert scanned - linear <= experts, "a scanned dense module the analysis lacks"
    assert not any("vision" in n or "visual" in n for n in chosen)


def test_alignment_of_a_vlm_on_text_measures_the_bundles_modules(saved_tiny_model, tmp_path):
    """LLaVA fed text only: the alignment analysis measures the bundle's modules (before, it hooked the vision
    tower too, which text never reaches, and refused: 'these layers saw no input')."""
    model, path = saved_tiny_model("llava")
    bundle = plate_inspect.scan(path, tmp_path / "b", r=4, tau=0.9, max_rank=16)
    ids = torch.randint(3, 64, (2, 6))
    records = weight_activation_alignment(copy.deepcopy(model).float(), [{"input_ids": ids}], ks=(2,), n_random=2)
    weights = {n: matrix_key(linear_weight(m)) for n, m in model.named_modules() if linear_weight(m) is not None}
    assert {weights[r.module] for r in records} == scanned_matrices(path, bundle.modules)[0]


def test_unknown_family_takes_the_numbered_layers_but_routers_as_the_scan_does():
    """A model_type the table does not know: every layer in the numbered layers except embeddings, norms, heads
    and routers (the scan's fallback); a projector outside the layers is left out once any layer is inside."""
    names = ["embed_tokens", "layers.0.attn.qkv", "layers.0.moe.router", "layers.0.moe.gate", "layers.1.mlp.fc",
             "projector.fc", "lm_head"]  # fmt: skip
    assert default_module_names(names, {"model_type": "my_arch"}) == ["layers.0.attn.qkv", "layers.1.mlp.fc"]
    assert default_module_names(["fc1", "fc2", "head"], {}) == ["fc1", "fc2"]
