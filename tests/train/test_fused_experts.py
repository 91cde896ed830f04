"""PLATE on MoE experts that transformers 5 holds fused as 3-D parameters (apply_bundle).

Each family's tiny model is saved with save_pretrained (per-expert tensors on disk for Qwen2/3-MoE, OLMoE and
Mixtral; 3-D tensors for Granite-MoE and gpt-oss) and scanned. The oracle places every bundle module's dense
update rho B A Q^T by hand (the family's fused layout written out below, not the code under test's mapping) into
a float64 copy of the fused parameters and runs the model's own forward on them.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402

import plate_inspect  # noqa: E402
from plate_inspect.bundle import Bundle  # noqa: E402
from plate_inspect.errors import BundleError  # noqa: E402
from plate_inspect.train.experts import PlateExperts, expert_branches  # noqa: E402
from plate_inspect.train.layer import (  # noqa: E402
    apply_bundle,
    load_adapter,
    merge_all,
    save_adapter,
    unload,
    unmerge_all,
)

H, I, E = 32, 24, 4  # hidden, expert intermediate, experts
SMALL = dict(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def config(family: str) -> transformers.PretrainedConfig:
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **SMALL, intermediate_size=48, moe_intermediate_size=I, head_dim=16, num_experts=E, num_experts_per_tok=2
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **SMALL, intermediate_size=48, moe_intermediate_size=I, shared_expert_intermediate_size=40,
            num_experts=E, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "olmoe":
        return transformers.OlmoeConfig(**SMALL, intermediate_size=I, num_experts=E, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(
            **SMALL, intermediate_size=I, head_dim=16, num_local_experts=E, num_experts_per_tok=2
        )
    if family == "granitemoe":
        return transformers.GraniteMoeConfig(**SMALL, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    assert family == "gpt_oss"
    return transformers.GptOssConfig(
        **SMALL, intermediate_size=I, head_dim=16, num_local_experts=E, num_experts_per_tok=2,
        layer_types=["full_attention"],
    )  # fmt: skip


FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe", "gpt_oss"]


def hand_placement(family: str, name: str) -> tuple[str, int, slice, bool] | None:
    """Where transformers 5 keeps bundle module ``name``: (fused parameter, expert, rows, in-major), written out
    per family from the modeling code (gate_up = [gate; up] along the output rows; gpt-oss holds [E, d_in, d_out])."""
    m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj", name)
    if m and family in ("qwen3_moe", "qwen2_moe", "olmoe"):
        stem, e, proj = m.group(1), int(m.group(2)), m.group(3)
        rows = {"gate": slice(0, I), "up": slice(I, 2 * I), "down": slice(0, H)}[proj]
        return f"{stem}.mlp.experts.{'down' if proj == 'down' else 'gate_up'}_proj", e, rows, False
    m = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)", name)
    if m and family == "mixtral":
        stem, e, w = m.group(1), int(m.group(2)), m.group(3)
        rows = {"w1": slice(0, I), "w3": slice(I, 2 * I), "w2": slice(0, H)}[w]
        return f"{stem}.mlp.experts.{'down' if w == 'w2' else 'gate_up'}_proj", e, rows, False
    m = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.(input|output)_linear\.(\d+)", name)
    if m and family == "granitemoe":
        proj = "gate_up_proj" if m.group(2) == "input" else "down_proj"
        return f"{m.group(1)}.block_sparse_moe.experts.{proj}", int(m.group(3)), slice(None), False
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts\.(?:gate_up|down)_proj)\.(\d+)", name)
    if m and family == "gpt_oss":
        return m.group(1), int(m.group(2)), slice(None), True
    return None


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{family: (checkpoint dir, bundle)}, built once per family on first use."""
    cache: dict[str, tuple] = {}

    def get(family: str, seed: int = 0):
        if (family, seed) not in cache:
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config(family))
            root = tmp_path_factory.mktemp(f"{family}{seed}")
            model.save_pretrained(root / "ckpt")
            bundle = plate_inspect.scan(str(root / "ckpt"), out=str(root / "bundle"), r=4, tau=0.9)
            cache[family, seed] = (root / "ckpt", bundle)
        return cache[family, seed]

    return get


def load(ckpt, **kwargs) -> torch.nn.Module:
    """The saved model in float32 (``experts_implementation="eager"``: the per-expert loop, which runs float64;
    the default grouped_mm does not)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **kwargs).eval()


def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (3, 16), generator=g)


def oracle_logits(family: str, ckpt, bundle: Bundle, a_by_name: dict[str, torch.Tensor], rho: float, x):
    """float64 logits of the plain model whose fused parameters carry rho B A Q^T per expert, placed by hand."""
    model = load(ckpt, experts_implementation="eager").double()
    fused = dict(model.named_parameters())
    deltas: dict[str, torch.Tensor] = {}
    for name, a in a_by_name.items():
        place = hand_placement(family, name)
        if place is None:  # a dense module (attention, shared expert): not in this oracle's scope
            continue
        pname, e, rows, in_major = place
        b_idx, q = bundle.b_idx(name), bundle.q(name, dtype=torch.float64)
        d = torch.zeros(bundle.record(name).shape, dtype=torch.float64)
        d[b_idx] = rho * a.double() @ q.t()  # B A Q^T by definition: rows B of a d_out x d_in zero matrix
        if pname not in deltas:
            deltas[pname] = torch.zeros_like(fused[pname])
        if in_major:
            deltas[pname][e, :, rows] = deltas[pname][e, :, rows] + d.t()
        else:
            deltas[pname][e, rows, :] = deltas[pname][e, rows, :] + d
    swapped = {n: fused[n].detach() + dl for n, dl in deltas.items()}
    return torch.func.functional_call(model, swapped, (x,)).logits, set(deltas)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_adapted_forward_and_grads_match_float64_oracle(made, family):
    ckpt, bundle = made(family)
    model = load(ckpt, experts_implementation="eager")
    params = apply_bundle(model, bundle, rho=0.5, modules=[n for n in bundle.modules if hand_placement(family, n)])
    branches = expert_branches(model)
    assert set(branches) == {n for n in bundle.modules if hand_placement(family, n)}
    assert len(branches) == 3 * E if family in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral") else 2 * E
    assert {id(p) for p in params} == {id(b.plate_A) for b in branches.values()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in params}  # everything else frozen
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g))
    x = ids()
    model.double()  # A, Q and the fused parameters in float64: the comparison is of the math alone
    out = model(x).logits
    a_leaves = {n: b.plate_A.detach().clone().requires_grad_(True) for n, b in branches.items()}
    want, touched = oracle_logits(family, ckpt, bundle, a_leaves, 0.5, x)
    assert len(touched) == 2  # gate_up and down of the one layer
    assert (out - want).abs().max().item() <= 1e-10 * max(1.0, want.abs().max().item())
    default = load(ckpt)  # transformers' default experts implementation (grouped_mm), float32
    apply_bundle(default, bundle, rho=0.5, modules=list(branches))
    for n, b in expert_branches(default).items():
        b.plate_A.data.copy_(branches[n].plate_A.detach())
    with torch.no_grad():
        assert (default(x).logits.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    for n, b in branches.items():
        assert b.plate_A.grad is not None
        assert torch.allclose(b.plate_A.grad, a_leaves[n].grad, rtol=1e-9, atol=1e-12), n
    hit = sum(int(b.plate_A.grad.abs().sum() > 0) for b in branches.values())
    assert hit >= len(branches) - 2  # routing reaches (nearly) every expert: the A's train


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_merge_unmerge_exact_and_save_reload(made, family, tmp_path):
    ckpt, bundle = made(family)
    model = load(ckpt)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = apply_bundle(model, bundle, rho=0.25)  # attention layers and experts together
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g))
    x = ids()
    with torch.no_grad():
        wrapped = model(x).logits
        merge_all(model)
        merged = model(x).logits
        unmerge_all(model)
        again = model(x).logits
    assert (merged - wrapped).abs().max().item() < 1e-5
    assert torch.equal(again, wrapped)
    experts = next(iter(m for m in model.modules() if isinstance(m, PlateExperts)))
    for pname, p in experts.base.named_parameters():  # bit for bit after unmerge
        full = next(n for n in original if n.endswith(f"experts.{pname}"))
        assert torch.equal(p, original[full]), pname
    save_adapter(model, tmp_path / "adapter.safetensors")
    fresh = load(ckpt)
    load_adapter(fresh, tmp_path / "adapter.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, wrapped)
    plain = unload(model)
    assert not any(isinstance(m, PlateExperts) for m in plain.modules())
    with torch.no_grad():
        assert (plain(x).logits - wrapped).abs().max().item() < 1e-5


def test_bundle_of_other_weights_is_refused_and_model_left_alone(made):
    ckpt, _ = made("qwen3_moe")
    _, other = made("qwen3_moe", seed=1)
    model = load(ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    experts_only = [n for n in other.modules if ".experts." in n]
    with pytest.raises(
        BundleError, match=r"module 'model\.layers\.0\.mlp\.experts\.0\.down_proj \(expert 0 of .*fingerprint differs"
    ):
        apply_bundle(model, other, modules=experts_only)
    assert not any(isinstance(m, PlateExperts) for m in model.modules())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_bf16_model_merge_unmerge_bit_exact(made):
    ckpt, bundle = made("mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = apply_bundle(model, bundle, modules=[n for n in bundle.modules if ".experts." in n])
    with torch.no_grad():
        for p in params:
            p.normal_()
        merge_all(model)
        changed = sum(
            int(not torch.equal(p, original[n.replace(".base.", ".")]))
            for n, p in model.named_parameters()
            if p.ndim == 3
        )
        unmerge_all(model)
    assert changed == 2
    for n, p in model.named_parameters():
        if p.ndim == 3:
            assert torch.equal(p, original[n.replace(".base.", ".")]), n


def peft_experts_a(peft_model) -> dict[str, torch.Tensor]:
    """The PEFT method's expert A's by bundle module name."""
    from plate_inspect.train.peft import PlateExpertsLayer

    out = {}
    for layer in peft_model.modules():
        if isinstance(layer, PlateExpertsLayer):
            for key, a in layer.plate_A["default"].items():
                out[layer.plate_slots["default"][key].bundle_name] = a
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_peft_method_adapts_fused_experts(made, family, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel, get_peft_model

    from plate_inspect.train.peft import PlateConfig, PlateExpertsLayer

    ckpt, bundle = made(family)
    experts = [n for n in bundle.modules if hand_placement(family, n)]
    pm = get_peft_model(load(ckpt, experts_implementation="eager"), PlateConfig(bundle=str(bundle.path), rho=0.5))
    a_by_name = peft_experts_a(pm)
    assert set(a_by_name) == set(experts)  # every expert, beside the attention layers
    assert sum(isinstance(m, PlateExpertsLayer) for m in pm.modules()) == 1
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for a in a_by_name.values():
            a.copy_(torch.randn(a.shape, generator=g))
    x = ids()
    pm.double()
    out = pm(input_ids=x).logits
    leaves = {n: a.detach().clone().requires_grad_(True) for n, a in a_by_name.items()}
    want, _ = oracle_logits(family, ckpt, bundle, leaves, 0.5, x)  # attention A's are zero: base attention
    assert (out - want).abs().max().item() <= 1e-10 * max(1.0, want.abs().max().item())
    out.sum().backward()
    want.sum().backward()
    for n, a in a_by_name.items():
        assert torch.allclose(a.grad, leaves[n].grad, rtol=1e-9, atol=1e-12), n
    with pm.disable_adapter(), torch.no_grad():
        base = pm(input_ids=x).logits
    with torch.no_grad():
        assert torch.equal(base, load(ckpt, experts_implementation="eager").double()(x).logits)
    pm.float()
    with torch.no_grad():
        adapted = pm(input_ids=x).logits
    pm.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(load(ckpt, experts_implementation="eager"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, adapted)
        pm.merge_adapter()
        assert (pm(input_ids=x).logits - adapted).abs().max().item() < 1e-5
        pm.unmerge_adapter()
    plain = again.merge_and_unload()
    assert not any(isinstance(m, PlateExpertsLayer) for m in plain.modules())
    with torch.no_grad():
        assert (plain(x).logits - adapted).abs().max().item() < 1e-5
    fused = dict(load(ckpt).named_parameters())
    for name, p in plain.named_parameters():
        if p.ndim == 3:  # the merged experts: W + rho B A Q^T by hand, float32 rounding
            delta = torch.zeros_like(p, dtype=torch.float64)
            for n, a in a_by_name.items():
                pname, e, rows, in_major = hand_placement(family, n)
                if pname == name:
                    d = torch.zeros(bundle.record(n).shape, dtype=torch.float64)
                    d[bundle.b_idx(n)] = 0.5 * a.detach().double() @ bundle.q(n, dtype=torch.float64).t()
                    if in_major:
                        delta[e, :, rows] += d.t()
                    else:
                        delta[e, rows, :] += d
            assert (p.double() - (fused[name].double() + delta)).abs().max().item() < 1e-5, name


def test_peft_experts_selected_like_lora_target_parameters(made):
    pytest.importorskip("peft")
    from peft import get_peft_model

    from plate_inspect.train.peft import PlateConfig

    ckpt, bundle = made("qwen3_moe")
    config = PlateConfig(bundle=str(bundle.path), target_modules=["mlp.experts.gate_up_proj", "q_proj"])
    pm = get_peft_model(load(ckpt), config)
    chosen = set(peft_experts_a(pm))
    assert chosen == {n for n in bundle.modules if re.search(r"experts\.\d+\.(gate|up)_proj$", n)}
    names = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert len(names) == 2 * E + 1 and sum("q_proj" in n for n in names) == 1


def test_peft_experts_refusals(made):
    pytest.importorskip("peft")
    from peft import get_peft_model

    from plate_inspect.errors import ConfigError
    from plate_inspect.train.peft import PlateConfig

    ckpt, bundle = made("qwen3_moe")
    _, other = made("qwen3_moe", seed=1)
    with pytest.raises(
        BundleError, match=r"module 'model\.layers\.0\.mlp\.experts\.0\.down_proj \(expert 0 of .*fingerprint differs"
    ):
        get_peft_model(load(ckpt), PlateConfig(bundle=str(other.path), target_modules=["mlp.experts.down_proj"]))
    with pytest.raises(ConfigError, match="carry_geometry=True.*lean only"):
        get_peft_model(load(ckpt), PlateConfig(bundle=str(bundle.path), carry_geometry=True))
    pm = get_peft_model(load(ckpt), PlateConfig(bundle=str(bundle.path)))
    pm.add_adapter("two", PlateConfig(bundle=str(bundle.path)))
    with pytest.raises(ConfigError, match="fused 3-D parameters, which add_weighted_adapter does not combine"):
        pm.add_weighted_adapter(["default", "two"], [0.5, 0.5], "mix")


@pytest.mark.parametrize("family", ["granitemoe", "gpt_oss"])
def test_3d_experts_in_a_cast_model_checked_against_the_source_slice(made, family):
    """A bf16 copy of float32 3-D experts passes the rounded-copy check (reference: that expert's slice of the
    source checkpoint's 3-D tensor); a 3% change of one expert is refused."""
    ckpt, bundle = made(family)
    experts = [n for n in bundle.modules if hand_placement(family, n)]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    assert len(apply_bundle(model, bundle, modules=experts)) == len(experts)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    pname, e, rows, _ = hand_placement(family, experts[-1])
    with torch.no_grad():
        model.get_parameter(pname)[e] *= 1.03
    with pytest.raises(BundleError, match=rf"{re.escape(experts[-1])} \(expert {e} of .*fingerprint differs"):
        apply_bundle(model, bundle, modules=experts)


def test_peft_two_expert_adapters_switch_and_delete(made):
    """set_adapter / delete_adapter reach the experts layer: adapter "two" alone gives apply_bundle's model with
    its A's and rho (oracle-checked above), and deleting it leaves "default" as it was."""
    pytest.importorskip("peft")
    from peft import get_peft_model

    from plate_inspect.train.peft import PlateConfig, PlateExpertsLayer

    ckpt, bundle = made("qwen3_moe")
    chosen = ["mlp.experts.down_proj"]
    pm = get_peft_model(load(ckpt), PlateConfig(bundle=str(bundle.path), target_modules=chosen))
    pm.add_adapter("two", PlateConfig(bundle=str(bundle.path), target_modules=chosen, rho=0.25))
    layer = next(m for m in pm.modules() if isinstance(m, PlateExpertsLayer))
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for name in ("default", "two"):
            for a in layer.plate_A[name].values():
                a.copy_(torch.randn(a.shape, generator=g))
    x = ids()
    with torch.no_grad():
        first = pm(input_ids=x).logits
        pm.set_adapter("two")
        second = pm(input_ids=x).logits
    assert all(a.requires_grad for a in layer.plate_A["two"].values())
    assert not any(a.requires_grad for a in layer.plate_A["default"].values())
    ref = load(ckpt)
    apply_bundle(ref, bundle, rho=0.25, modules=[n for n in bundle.modules if n.endswith("down_proj")])
    by_slot = {layer.plate_slots["two"][k].bundle_name: a for k, a in layer.plate_A["two"].items()}
    with torch.no_grad():
        for n, b in expert_branches(ref).items():
            b.plate_A.copy_(by_slot[n])
        assert torch.equal(ref(x).logits, second)
    pm.set_adapter("default")
    pm.delete_adapter("two")
    assert list(layer.plate_A) == ["default"] and list(layer.plate_slots) == ["default"]
    with torch.no_grad():
        assert torch.equal(pm(input_ids=x).logits, first)
