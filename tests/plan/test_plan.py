"""plate-inspect plan: budget parsing, captured energy of Q prefixes against a dense oracle, greedy optimality."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers_plan import curve
from oracles import load_all
from safetensors.torch import load_file

from plate_inspect import scan
from plate_inspect.bundle import Bundle
from plate_inspect.cli.main import cli
from plate_inspect.errors import ConfigError
from plate_inspect.plan import (
    PLAN_FORMAT,
    allocate,
    captured_energy_curve,
    parse_budget,
    plan_budget,
    planned_captured_energy,
)
from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A float32 Qwen2-layout model scanned at a low tau (room to plan): tall, square and wide modules."""
    root = tmp_path_factory.mktemp("plan")
    ckpt = write_llama_like(root / "model", layers=2, dtype=torch.float32, planted_fraction=0.1)
    return scan(ckpt.path, root / "bundle", r=8, tau=0.5, max_rank=512), ckpt.path


def manifest_records(bundle: Bundle) -> list[dict]:
    return list(json.loads((bundle.path / "manifest.json").read_text())["modules"].values())


def test_parse_budget(bundle):
    b, _ = bundle
    recs = manifest_records(b)  # shapes straight from the manifest JSON
    weights = sum(r["shape"][0] * r["shape"][1] for r in recs)
    lora16 = 16 * sum(r["shape"][0] + r["shape"][1] for r in recs)
    records = list(b)
    assert parse_budget("2e6", records).params == 2_000_000
    assert parse_budget("2,000,000", records).params == 2_000_000
    assert parse_budget("12345", records).params == 12345
    assert parse_budget("1%", records).params == math.floor(0.01 * weights)
    assert parse_budget("2.5 %", records).params == math.floor(0.025 * weights)
    for spec in ("lora:16", "LoRA=16", "as LoRA r=16", "lora r=16", "lora 16", "LoRA16"):
        got = parse_budget(spec, records)
        assert (got.kind, got.params) == ("lora", lora16), spec
    for bad in ("abc", "0%", "150%", "lora:0", "-5", "", "nan", "1e400", "1.5", "2000.25", "lora 1.5"):
        with pytest.raises(ConfigError, match="--budget"):
            parse_budget(bad, records)


def test_prefix_of_q_captures_what_the_spectrum_says(bundle):
    """Dense oracle: tr(Q_k^T G Q_k) / tr(G) in float64 for prefixes of the stored Q, G from the weight and B."""
    b, ckpt = bundle
    weights = load_all(ckpt)
    seen = set()
    for rec in b:
        part = load_file(str(b.path / rec.file))
        q = part[f"{rec.name}.plate_Q"].double().numpy()
        b_idx = part[f"{rec.name}.plate_B_idx"].numpy()
        w = weights[f"{rec.name}.weight"].double().numpy()
        frozen = np.delete(w, b_idx, axis=0)
        g = frozen.T @ frozen
        seen.add("wide" if frozen.shape[0] < frozen.shape[1] else "tall")
        ks = sorted({1, 2, rec.k // 3, rec.k // 2, rec.k - 1, rec.k} - {0})
        for k in ks:
            oracle = float(np.trace(q[:, :k].T @ g @ q[:, :k]) / np.trace(g))
            # and the definition: the k smallest eigenvalues of G (numpy, float64)
            smallest = float(np.sort(np.linalg.eigvalsh(g))[:k].clip(0).sum() / np.trace(g))
            planned = planned_captured_energy(b.spectrum(rec.name), rec.d_in, k)
            assert planned == pytest.approx(oracle, abs=2e-6), (rec.name, k)
            assert planned == pytest.approx(smallest, abs=2e-6), (rec.name, k)
    assert seen == {"wide", "tall"}


def test_captured_energy_curve_by_hand():
    # G's eigenvalues: [5, 3, 2] stored (descending) for d_in = 5: two implicit zeros
    c = captured_energy_curve(torch.tensor([5.0, 3.0, 2.0]), 5)
    assert c.tolist() == pytest.approx([0, 0, 0, 0.2, 0.5, 1.0])
    assert captured_energy_curve(torch.zeros(3), 4).tolist() == [0.0] * 5


def test_allocation_by_hand():
    """A: eigenvalues (ascending) [0.1, 0.1, 5, 5] -> c = [0, .0098, .0196, .51, 1]; B: [1, 1.2, 1.4, 10] ->
    c = [0, .0735, .1618, .2647, 1]. r = 1, k in [1, 3], budget 4: start (1, 1) with 2 spent.
    minimax: next levels A .0196 < B .1618 -> A=2; then A .51 > B .1618 -> B=2. Result (2, 2).
    mean: increments A .0098 < B .0882 -> A=2; then A .49 > B .0882 -> B=2. Result (2, 2).
    budget 5, minimax: then A .51 vs B .2647 -> B=3: (2, 3); mean: A .49 vs B .1029 -> B=3: (2, 3)."""
    curves = [curve([0.1, 0.1, 5, 5]), curve([1, 1.2, 1.4, 10])]
    assert allocate(curves, [1, 1], [3, 3], 4, "minimax") == [2, 2]
    assert allocate(curves, [1, 1], [3, 3], 4, "mean") == [2, 2]
    assert allocate(curves, [1, 1], [3, 3], 5, "minimax") == [2, 3]
    # C: high starting level, flat increments; D: low level, one large eigenvalue at the top
    c_mod, d_mod = curve([4, 4, 4.01, 4.02]), curve([0.001, 0.5, 0.6, 20])
    # minimax (levels): C c(2)=.4994 vs D c(2)=.0237 -> D=2; C .4994 vs D c(3)=.0535 -> D=3 (budget 4 spent)
    assert allocate([c_mod, d_mod], [1, 1], [3, 3], 4, "minimax") == [1, 3]
    # budget 5: D is at its bundle k=3, so C=2
    assert allocate([c_mod, d_mod], [1, 1], [3, 3], 5, "minimax") == [2, 3]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("objective", ["minimax", "mean"])
def test_allocation_is_optimal_by_brute_force(seed, objective):
    """Equal r: among ALL allocations spending as much, none has a smaller max (minimax) / sum (mean)."""
    g = torch.Generator().manual_seed(seed)
    n_mod, r = 3, 2
    curves, k_max = [], []
    for _ in range(n_mod):
        d_in = int(torch.randint(4, 7, (1,), generator=g))
        lam = torch.rand(d_in, generator=g, dtype=torch.float64) ** 3
        lam[: int(torch.randint(0, 3, (1,), generator=g))] = 0.0  # some null directions
        curves.append(curve(sorted(lam.tolist())))
        k_max.append(int(torch.randint(2, d_in + 1, (1,), generator=g)))
    for budget in range(n_mod * r, r * sum(k_max) + 3):
        ks = allocate(curves, [r] * n_mod, k_max, budget, objective)
        spent = r * sum(ks)
        assert spent <= budget and all(1 <= k <= m for k, m in zip(ks, k_max, strict=True))
        assert spent == r * min(budget // r, sum(k_max))  # spends all it can
        score = (
            (lambda a: max(float(c[k]) for c, k in zip(curves, a, strict=True)))
            if objective == "minimax"
            else (lambda a: sum(float(c[k]) for c, k in zip(curves, a, strict=True)))
        )
        best = min(score(a) for a in itertools.product(*[range(1, m + 1) for m in k_max]) if r * sum(a) == spent)
        assert score(ks) <= best + 1e-12, (budget, ks)


def test_plan_on_bundle_respects_budget_and_writes_format(bundle, tmp_path):
    b, _ = bundle
    for spec in ("1%", "lora:1", "3000"):
        for objective in ("minimax", "mean"):
            plan = plan_budget(b, spec, objective)
            data = plan.to_json()
            assert data["budget"]["spent"] <= data["budget"]["params"]
            assert data["budget"]["spent"] == sum(rec.r * data["modules"][rec.name]["k"] for rec in b)
            for rec in b:
                m = data["modules"][rec.name]
                assert 1 <= m["k"] <= rec.k and m["tau"] == pytest.approx(1 - m["captured_energy"])
    plan = plan_budget(b, "lora:1")
    data = plan.to_json()
    assert data["format"] == PLAN_FORMAT and data["format_version"] == 1
    assert data["bundle"] == {"identity": b.manifest.identity, "path": str(b.path.resolve())}
    assert data["objective"] == "minimax" and set(data["modules"]) == set(b.modules)
    # a generous budget stops at the bundle's Q: every module at its bundle k, flagged
    big = plan_budget(b, "1e9").to_json()
    assert all(big["modules"][rec.name]["k"] == rec.k for rec in b) and big["budget"]["limited_by_bundle"]
    with pytest.raises(ConfigError, match="below the minimum"):
        plan_budget(b, "10")


def test_cli_plan(bundle, tmp_path):
    b, _ = bundle
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "as LoRA r=2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["budget"]["kind"] == "lora" and data["budget"]["spent"] <= data["budget"]["params"]
    result = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "lots"])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output


def test_cli_plan_json_writes_no_file_unless_asked(bundle, tmp_path, monkeypatch):
    """QA: `plan B --budget 1% --json | jq` also wrote ./plan.json (the -o default), silently replacing any plan of
    another bundle there. With --json the plan goes to stdout only, unless -o names a file."""
    b, _ = bundle
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("my other plan\n")
    result = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "1%", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == plan_budget(b, "1%").to_json()
    assert (tmp_path / "plan.json").read_text() == "my other plan\n"
    out = tmp_path / "sub" / "p.json"
    result = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "1%", "--json", "-o", str(out)])
    assert result.exit_code == 0 and json.loads(out.read_text()) == json.loads(result.stdout)
    assert f"plan: {out}" in result.stderr
    result = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "1%"])  # the summary: ./plan.json as before,
    assert result.exit_code == 2 and "exists and is not a plan JSON" in result.output  # which is not a plan: kept
    assert (tmp_path / "plan.json").read_text() == "my other plan\n"
    (tmp_path / "plan.json").write_text(out.read_text().replace('"1%"', '"2%"'))  # an earlier plan: replaced
    assert json.loads((tmp_path / "plan.json").read_text())["budget"]["spec"] == "2%"
    result = CliRunner().invoke(cli, ["plan", str(b.path), "--budget", "1%"])
    assert result.exit_code == 0 and json.loads((tmp_path / "plan.json").read_text())["budget"]["spec"] == "1%"


@pytest.mark.parametrize("variant", ["random_b", "high_energy_q"])
def test_ablation_bundles_are_not_planned(bundle, tmp_path, variant):
    """QA: `plan` on an ablation bundle priced Q's columns with the stored spectrum, which the ablation copies from
    its source: planned max captured energy 0.005, while Q[:, :k] measured with numpy captured up to 0.996
    (high_energy_q) or 0.06 (random_b). Such bundles are refused; the oracle below shows why."""
    from plate_inspect.train.variants import make_variant

    b, ckpt = bundle
    vb = make_variant(b, ckpt, variant, tmp_path / variant)
    weights = load_all(ckpt)
    gaps = []
    for rec in vb:
        w = weights[f"{rec.name}.weight"].double().numpy()
        keep = np.setdiff1d(np.arange(w.shape[0]), vb.b_idx(rec.name).numpy())
        g = w[keep].T @ w[keep]
        q = vb.q(rec.name).double().numpy()
        k = q.shape[1]
        measured = np.trace(q.T @ g @ q) / np.trace(g)
        gaps.append(abs(measured - planned_captured_energy(vb.spectrum(rec.name), rec.d_in, k)))
    assert max(gaps) > 0.01  # the spectrum does not price this Q
    with pytest.raises(ConfigError, match=f"is a {variant} ablation bundle.*plan the PLATE bundle"):
        plan_budget(vb, "1%")
    result = CliRunner().invoke(cli, ["plan", str(vb.path), "--budget", "1%", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "ablation" in result.output and not (tmp_path / "p.json").exists()
