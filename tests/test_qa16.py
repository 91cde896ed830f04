"""Session-16 QA: problems a user meets with whole-stack layer selections (``layers=`` in the Python API,
``plate-inspect info`` of a one-stack bundle), and an independent check of ``plan --budget``'s exact allocation.

Oracles: the nn.Linear modules transformers builds in each stack of a tiny BART it saved itself (named by
transformers), the layer indices of the checkpoint's own tensor names, and a plan computed here by exhaustive
dynamic programming over the spend from the spectra stored in the bundle's safetensors files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_layers_stacks import _run, _want, models  # noqa: F401 (models: a fixture)

import plate_inspect
from plate_inspect.bundle import ScanSettings
from plate_inspect.errors import ConfigError
from plate_inspect.targets import parse_layers
from plate_inspect.testing.synthetic import write_llama_like


def _layer_of(name: str) -> int:
    """The layer index in a Qwen2 module name (``model.layers.<i>.…``), read from the name itself."""
    return int(name.split(".")[2])


def test_a_layers_string_is_refused_not_read_as_its_characters(qwen_ckpt, models, tmp_path):  # noqa: F811
    """``layers="10"`` used to be iterated character by character: layers 1 and 0, i.e. the whole model, without a
    word; ``layers="decoder"`` gave "no layer stack 'd'". A string must be a spec expanded by parse_layers."""
    for spec in ("10", "1"):
        with pytest.raises(ConfigError, match=rf"layers='{spec}': a string.*parse_layers\('{spec}'\)"):
            plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=4, max_rank=16, layers=spec)
        with pytest.raises(ConfigError, match=r"a string, not a list of entries"):
            ScanSettings(layers=spec)
    assert not (tmp_path / "b").exists()
    bart, layers = models["bart"]
    with pytest.raises(ConfigError, match=r"layers='decoder': a string"):
        plate_inspect.audit(bart, bart, r=4, layers="decoder")
    # the spec expanded: what a user meant
    one = plate_inspect.scan(qwen_ckpt.path, tmp_path / "one", r=4, max_rank=16, layers=parse_layers("1"))
    assert one.modules and {_layer_of(n) for n in one.modules} == {1}
    records = plate_inspect.audit(bart, bart, r=4, layers=parse_layers("decoder"))
    decoder = _want(layers, *sorted(k for k in layers if k[0] == "decoder"))
    assert sorted(r.module for r in records) == decoder


def test_info_names_the_layer_selection(models, qwen_ckpt, tmp_path):  # noqa: F811
    """``info`` of a bundle of one stack used to read like one of the whole model ('targets: defaults for ...')."""
    bart, layers = models["bart"]
    for spelling, shown in (("decoder", "decoder"), ("encoder,decoder:0-1", "decoder:0,decoder:1,encoder")):
        out = tmp_path / spelling.replace(",", "_").replace(":", "")
        code, output = _run("scan", bart, "--out", out, "--r", "4", "--max-rank", "16", "--layers", spelling, "-q")
        assert code == 0, output
        code, output = _run("info", out)
        assert code == 0, output
        line = next(x for x in output.splitlines() if x.startswith("targets:"))
        assert line == f"targets: defaults for model_type 'bart'; layers {shown}", output
    code, output = _run("scan", qwen_ckpt.path, "--out", tmp_path / "q", "--r", "4", "--max-rank", "16", "-q")
    assert code == 0, output
    line = next(x for x in _run("info", tmp_path / "q")[1].splitlines() if x.startswith("targets:"))
    assert "layers" not in line  # no selection: nothing added


# --------------------------------------------------------------------------- plan --budget against a brute force
def _oracle_plan(bundle_dir, modules: dict, budget: int, objective: str) -> tuple[int, float]:
    """(most parameters spendable within ``budget``, the best objective among plans spending exactly that), by
    dynamic programming over the spend with every k in 1..bundle k, from the bundle's stored spectra."""
    spectra = {}
    for f in bundle_dir.glob("*.safetensors"):
        spectra.update({k[: -len(".spectrum")]: v for k, v in load_file(f).items() if k.endswith(".spectrum")})
    curves, ranks, kmax = [], [], []
    for name, m in modules.items():
        lam = np.sort(spectra[name].astype(np.float64).clip(0))  # ascending; G's other d_in - len are zero
        lam = np.concatenate([np.zeros(m["d_in"] - len(lam)), lam])
        curves.append(np.concatenate([[0.0], np.cumsum(lam)]) / lam.sum())
        ranks.append(m["r"])
        kmax.append(m["bundle_k"])
    # best[s] = best objective (max or sum) over the modules so far spending exactly s (inf: not reachable)
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0
    for c, r, kk in zip(curves, ranks, kmax, strict=True):
        nxt = np.full(budget + 1, np.inf)
        for k in range(1, min(kk, budget // r) + 1):
            shifted = best[: budget + 1 - r * k]
            value = np.maximum(shifted, c[k]) if objective == "minimax" else shifted + c[k]
            nxt[r * k :] = np.minimum(nxt[r * k :], value)
        best = nxt
    spend = int(np.flatnonzero(np.isfinite(best)).max())
    return spend, best[spend] / (len(curves) if objective == "mean" else 1)


@pytest.fixture(scope="module")
def three_r_bundle(tmp_path_factory):
    """r = 64 on a 64-wide fp32 model: q/o/down keep r = 57, k/v 28, gate/up 64 (three different r)."""
    root = tmp_path_factory.mktemp("qa16plan")
    ckpt = write_llama_like(root / "model", layers=2, dtype=torch.float32, planted_fraction=0.1)
    return plate_inspect.scan(ckpt.path, root / "bundle", r=64, tau=0.6, max_rank=512)


@pytest.mark.parametrize("objective", ["minimax", "mean"])
def test_plan_budget_equals_an_exhaustive_search(three_r_bundle, objective, tmp_path):
    """The CLI's plan file spends the most the budget allows and has the best objective at that spend, for budgets
    at the edges: just above the minimum (sum of r), 1%, mid-range, and beyond what the bundle holds."""
    b = three_r_bundle
    assert len({rec.r for rec in b}) == 3
    minimum = sum(rec.r for rec in b)
    capacity = sum(rec.r * rec.k for rec in b)
    for budget in (minimum, minimum + 1, minimum + 211, 3000, capacity - 1, capacity + 10**6):
        out = tmp_path / f"{objective}-{budget}.json"
        code, output = _run("plan", b.path, "--budget", budget, "--objective", objective, "-o", out)
        assert code == 0, output
        plan = json.loads(out.read_text())
        spend, best = _oracle_plan(b.path, plan["modules"], min(budget, capacity), objective)
        assert plan["budget"]["spent"] == spend == sum(m["r"] * m["k"] for m in plan["modules"].values()), budget
        key = "max_captured_energy" if objective == "minimax" else "mean_captured_energy"
        assert plan["summary"][key] == pytest.approx(best, rel=1e-9, abs=1e-15), budget
        assert plan["optimality"]["method"] == "exact"
        assert plan["budget"]["limited_by_bundle"] == (budget > capacity)
    code, output = _run("plan", b.path, "--budget", minimum - 1, "-o", tmp_path / "low.json")
    assert code == 2 and f"below the minimum {minimum}" in output, output


def test_layers_there_names_the_stack_of_a_one_stack_selection(models):  # noqa: F811
    """A decoder-only bundle's layers, in an error about a selection keeping none of them, read 'decoder 0-2' where
    the model has two stacks (they read '0-2': layers 0-2 of both stacks, which the bundle does not hold)."""
    from plate_inspect.targets import layers_there

    for family in ("t5", "bart"):
        _, layers = models[family]
        decoder = _want(layers, *sorted(k for k in layers if k[0] == "decoder"))
        every = _want(layers, *layers)
        assert layers_there(decoder, every) == "decoder 0-2", family
        assert layers_there(decoder) == "0-2"  # without the model: nothing tells one stack from the other
        assert layers_there(every, every) == layers_there(every) == "encoder 0-1, decoder 0-2"
        assert layers_there(_want(layers, ("encoder", 1)), every) == "encoder 1"


def test_a_one_layer_stack_is_described_in_the_singular(tmp_path):
    """Gemma-3's vision tower has one layer here (its tensor names hold only index 0): '1 layer: 0', not '1 layers'."""
    from safetensors import safe_open

    from plate_inspect.testing.synthetic import write_family

    path = write_family(tmp_path / "gemma3", "gemma3").path
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        vision = {k.split(".")[4] for k in f.keys() if k.startswith("vision_tower.vision_model.encoder.layers.")}  # noqa: SIM118
    assert vision == {"0"}
    code, output = _run("scan", path, "--out", tmp_path / "b", "--layers", "middle", "-q")
    assert code == 2 and "(vision_tower.vision_model.encoder.layers, 1 layer: 0)" in output, output
    assert "2 layers: 0-1" in output, output
    code, output = _run("scan", path, "--out", tmp_path / "b", "--layers", "vision_tower:3", "-q")
    assert code == 2 and "(vision_tower.vision_model.encoder.layers) has 1 layer (0), no layer 3" in output, output


def test_audit_error_names_the_stack_a_one_stack_bundle_holds(models, tmp_path):  # noqa: F811
    """(needs /work/notes/qa16-auditing.py.patch) ``audit --bundle <decoder bundle> --layers encoder``: the error
    names the bundle's layers as 'decoder 0-2' (it said '0-2')."""
    bart, _ = models["bart"]
    code, output = _run("scan", bart, "--out", tmp_path / "d", "--r", "4", "--max-rank", "16", "--layers", "decoder",
                        "-q")  # fmt: skip
    assert code == 0, output
    code, output = _run("audit", bart, bart, "--bundle", tmp_path / "d", "--layers", "encoder")
    assert code == 2 and output.rstrip().endswith("its layers: decoder 0-2"), output
