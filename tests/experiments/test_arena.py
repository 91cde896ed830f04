"""The arena's methods against independent oracles: penalties, budgets, PEFT inits, data readers, the trainer."""

from __future__ import annotations

import gzip
import json
import math
import struct

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from plate_inspect.cli.main import cli
from plate_inspect.errors import ConfigError
from plate_inspect.experiments import digits
from plate_inspect.experiments import methods as M

SHAPES = [(256, 64), (256, 256), (256, 256)]  # fc1, fc2, fc3 of the digits MLP (d_out, d_in)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    out = tmp_path_factory.mktemp("arena_stage1")
    task1, _ = digits.load_digit_tasks()
    model = digits.train_stage1(task1, seed=0, steps=60)
    digits.save_model(model, out / "stage1.safetensors")
    init = digits.initial_model(64, 0).state_dict()
    return M.StageOne(0, out, out / "stage1.safetensors", task1, init)


def _weights(stage1) -> dict[str, np.ndarray]:
    model = digits.load_model(stage1.checkpoint)
    return {m: getattr(model, m).weight.detach().double().numpy() for m in M.BACKBONE}


# --------------------------------------------------------------------------- penalties
def test_l2_init_penalty_hand_computed():
    p = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([[0.5]], dtype=torch.float64)]
    a = [torch.tensor([0.0, 4.0], dtype=torch.float64), torch.tensor([[1.5]], dtype=torch.float64)]
    # (1-0)^2 + (2-4)^2 + (0.5-1.5)^2 = 1 + 4 + 1 = 6
    assert float(M.l2_init_penalty(p, a, 0.1)) == pytest.approx(0.6, rel=1e-12)


def test_olora_penalty_hand_computed():
    old = [torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)]
    new = [torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0]], dtype=torch.float64)]
    # A_old A_new^T = [[3, 0]] -> squared Frobenius 9; lam 0.5 -> 4.5
    assert float(M.olora_penalty(old, new, 0.5)) == pytest.approx(4.5, rel=1e-12)
    orth = [torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)]
    assert float(M.olora_penalty(orth, [torch.tensor([[5.0, 0.0, 7.0]], dtype=torch.float64)])) == 0.0


def test_task1_lora_basis_recovers_planted_subspace():
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    s = torch.tensor([9.0, 5.0, 3.0] + [1e-3] * 9, dtype=torch.float64)
    w0 = torch.randn(20, 12, generator=g, dtype=torch.float64)
    w1 = w0 + u[:, :12] @ torch.diag(s) @ v.T
    a1 = M.task1_lora_basis(w1, w0, 3)
    assert a1.shape == (3, 12)
    assert torch.allclose(a1 @ a1.T, torch.eye(3, dtype=torch.float64), atol=1e-10)
    proj_true = v[:, :3] @ v[:, :3].T
    assert torch.allclose(a1.T @ a1, proj_true, atol=1e-8)


# --------------------------------------------------------------------------- wiring and budgets
def test_every_method_is_a_no_op_at_init_and_counts_its_closed_form_budget(stage1):
    task1 = stage1.task1
    ref = digits.load_model(stage1.checkpoint)
    with torch.no_grad():
        ref_logits = ref(task1.x_test, task=1)
    expected = {
        "full_ft": lambda c: 64 * 256 + 256 + 2 * (256 * 256 + 256),
        "l2_init": lambda c: 148_224,
        "lora": lambda c: c["rank"] * (64 + 256) + 2 * c["rank"] * (256 + 256),
        "o_lora": lambda c: c["rank"] * (64 + 256) + 2 * c["rank"] * (256 + 256),
        "pissa": lambda c: c["rank"] * (64 + 256) + 2 * c["rank"] * (256 + 256),
        "corda": lambda c: c["rank"] * (64 + 256) + 2 * c["rank"] * (256 + 256),
        "mica": lambda c: c["rank"] * (64 + 256 + 256),  # only A trains
        "osf": lambda c: c["n_low"] * ((256 + 64 + 1) + 2 * (256 + 256 + 1)),
    }
    for method in ("full_ft", "l2_init", "lora", "o_lora", "pissa", "mica", "osf", "corda", "plate", "plate_random_q"):
        for budget in M.default_budgets(method)[:2]:
            prep = M.prepare(method, budget.config, stage1)
            with torch.no_grad():
                logits = prep.model(task1.x_test, task=1)
            assert torch.allclose(logits, ref_logits, atol=2e-4), (method, budget.id)  # no-op before training
            if method.startswith("plate"):
                from plate_inspect.bundle import Bundle

                path = stage1.bundle(budget.config["r"], budget.config["tau"], method.removeprefix("plate_") or None)
                want = sum(rec.r * rec.k for rec in Bundle.load(path))
            else:
                want = expected[method](budget.config)
            assert prep.trainable_params == want, (method, budget.id)
            counted = sum(p.numel() for p in prep.params if p.requires_grad) - (256 * 5 + 5)  # minus head 2
            assert counted == want, (method, budget.id)


def test_closed_forms_match_hand_numbers():
    assert M.lora_trainable(SHAPES, 8) == 10_752
    assert M.mica_trainable(SHAPES, 8) == 4_608
    assert M.osf_trainable(SHAPES, 1) == 1_347


def test_pissa_and_mica_inits_are_peft_svd_inits(stage1):
    w = _weights(stage1)["fc2"]
    u, s, vt = np.linalg.svd(w)
    rank = 4
    pissa = M.prepare("pissa", {"rank": rank}, stage1).model.base_model.model.fc2
    ba = 0.5 * (pissa.lora_B["default"].weight @ pissa.lora_A["default"].weight).detach().double().numpy()
    top = u[:, :rank] @ np.diag(s[:rank]) @ vt[:rank]
    assert np.allclose(ba, top, atol=1e-4)  # PiSSA: the adapter holds the top-r SVD part ...
    assert np.allclose(pissa.base_layer.weight.detach().double().numpy(), w - top, atol=1e-4)  # ... and W the rest
    mica = M.prepare("mica", {"rank": rank}, stage1).model.base_model.model.fc2
    b = mica.lora_B["default"].weight.detach().double().numpy()
    assert np.allclose(np.abs(b.T @ u[:, -rank:]), np.eye(rank), atol=1e-4)  # B = bottom-r left singular vectors
    assert not mica.lora_B["default"].weight.requires_grad and mica.lora_A["default"].weight.requires_grad
    assert float(mica.lora_A["default"].weight.detach().abs().max()) == 0.0
    plain = M.prepare("lora", {"rank": rank}, stage1).model.base_model.model.fc2
    assert float(plain.lora_B["default"].weight.abs().max()) == 0.0 and float(plain.lora_A["default"].weight.std()) > 0


def test_osf_trains_the_bottom_singular_triplets(stage1):
    w = _weights(stage1)["fc1"]  # 256 x 64
    _, s, vt = np.linalg.svd(w, full_matrices=False)
    prep = M.prepare("osf", {"n_low": 3}, stage1)
    layer = prep.model.base_model.model.fc1
    params = layer.osf_svd_params["default"]
    assert np.allclose(params["S_low"].detach().double().numpy(), s[-3:], rtol=1e-4)
    v_low = params["V_low"].detach().double().numpy()
    assert np.allclose(np.abs(v_low @ vt[-3:].T), np.eye(3), atol=1e-3)
    assert prep.config["effective_rank"] == {"fc1": 61, "fc2": 253, "fc3": 253}


def test_corda_kpm_uses_task1_covariance(stage1):
    x = stage1.task1.x_train.double().numpy()
    w = _weights(stage1)["fc1"]
    c = x.T @ x / np.abs(x).max() ** 2
    c_fix = c + np.eye(c.shape[0]) * np.mean(np.diag(c)) * 0.01
    u, s, vh = np.linalg.svd(w @ c_fix, full_matrices=False)
    rank = 4
    oracle = u[:, -rank:] @ np.diag(s[-rank:]) @ (vh @ np.linalg.inv(c_fix))[-rank:]  # KPM: the smallest components
    prep = M.prepare("corda", {"rank": rank}, stage1)
    layer = prep.model.base_model.model.fc1
    ba = 0.5 * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach().double().numpy()
    assert np.allclose(ba, oracle, atol=2e-3 * np.abs(oracle).max())
    assert prep.config["data_using"].startswith("task-1")


def test_o_lora_penalty_is_wired_to_the_task1_update(stage1):
    w1 = _weights(stage1)
    prep = M.prepare("o_lora", {"rank": 2}, stage1)
    total = 0.0
    for m in M.BACKBONE:
        w0 = stage1.init_state[f"{m}.weight"].double().numpy()
        _, _, vt = np.linalg.svd(w1[m] - w0)
        a_new = prep.model.base_model.model.get_submodule(m).lora_A["default"].weight.detach().double().numpy()
        total += float(((vt[:2] @ a_new.T) ** 2).sum())
    assert float(prep.penalty()) == pytest.approx(0.5 * total, rel=1e-4)


def test_l2_init_penalty_is_wired_to_the_pre_task2_weights(stage1):
    prep = M.prepare("l2_init", {"lam": 0.1}, stage1)
    assert float(prep.penalty()) == 0.0
    with torch.no_grad():
        prep.model.fc2.weight[3, 4] += 2.0
        prep.model.fc3.bias[0] -= 1.0
    assert float(prep.penalty()) == pytest.approx(0.1 * (4.0 + 1.0), rel=1e-5)


def test_parse_methods_refuses_unknown():
    assert M.parse_methods(" lora, plate") == ["lora", "plate"]
    with pytest.raises(ConfigError, match="--methods lists lora twice"):
        M.parse_methods("lora, plate,lora")
    with pytest.raises(ConfigError, match="unknown method 'adapter'"):
        M.parse_methods("lora,adapter")


# --------------------------------------------------------------------------- trainer and data
def test_epochs_equal_steps_and_one_stage1_trainer(tmp_path):
    task1, _ = digits.load_digit_tasks()
    a = digits.train_stage1(task1, seed=3, epochs=2)
    b = digits.train_stage1(task1, seed=3, steps=2 * math.ceil(task1.x_train.shape[0] / 128))
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    from plate_inspect.analysis.curvature import digits_stage1

    setup = digits_stage1(tmp_path, epochs=2, seed=3)  # the analysis calls the same trainer
    assert all(torch.equal(p, a.state_dict()[n]) for n, p in setup.model.state_dict().items())


def _write_idx(path, array: np.ndarray) -> None:
    header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reader_on_planted_idx_files(tmp_path):
    from plate_inspect.experiments.fashion_mnist import load_fashion_tasks, read_idx

    rng = np.random.default_rng(0)
    labels = {"train": np.arange(20) % 10, "test": np.arange(10)}
    images = {k: rng.integers(0, 256, size=(len(v), 28, 28)) for k, v in labels.items()}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images[split])
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels[split])
    assert np.array_equal(read_idx(tmp_path / "train-images-idx3-ubyte.gz"), images["train"])
    t1, t2 = load_fashion_tasks(tmp_path)
    assert t1.x_train.shape == (10, 784) and t1.d_in == 784
    keep = labels["train"] >= 5
    assert np.allclose(t2.x_train.numpy(), images["train"][keep].reshape(-1, 784) / 255.0)
    assert t2.y_train.tolist() == (labels["train"][keep] - 5).tolist()
    assert t1.y_test.tolist() == [0, 1, 2, 3, 4]


def test_fashion_mnist_missing_files_say_how_to_get_them(tmp_path):
    from plate_inspect.experiments.fashion_mnist import load_fashion_tasks

    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_tasks(tmp_path)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x0d\x01garbage"))
    for name in ("train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x01\x07"))
    with pytest.raises(ConfigError, match="not an unsigned-byte IDX file"):
        load_fashion_tasks(tmp_path)


# --------------------------------------------------------------------------- the four-task protocol
def test_sequential_protocol_merges_plate_only_into_b_rows(tmp_path):
    from plate_inspect.bundle import Bundle
    from plate_inspect.experiments.sequential_tasks import run_sequential

    result = run_sequential(tmp_path, ["plate", "lora"], seeds=1, steps=15)
    for method in ("plate", "lora"):
        m = result.matrix(method)
        assert all(m[t][j] is not None for t in range(4) for j in range(t + 1))  # every earlier task, every merge
        assert all(m[t][j] is None for t in range(4) for j in range(t + 1, 4))
    seed_dir = tmp_path / "seed0" / "plate"
    prev = digits.load_model(tmp_path / "seed0" / "task1.safetensors")
    for t, bundle_dir in ((2, seed_dir / "bundle_t1"), (3, seed_dir / "merged_t2" / "bundle")):
        bundle = Bundle.load(bundle_dir)
        merged = digits.load_model(seed_dir / f"merged_t{t}" / "model.safetensors")
        for name in M.BACKBONE:
            w0, w1 = prev.get_submodule(name).weight, merged.get_submodule(name).weight
            outside = torch.ones(w0.shape[0], dtype=torch.bool)
            outside[bundle.b_idx(name)] = False
            assert torch.equal(w0[outside], w1[outside])  # rows outside B never move
            assert not torch.equal(w0, w1)
        prev = merged


def test_sequential_refuses_unknown_methods_and_bad_seeds(tmp_path):
    """The API used to run OSF for any name that was not 'plate' or 'lora' (and label it with that name)."""
    from plate_inspect.experiments.sequential_tasks import run_sequential

    with pytest.raises(ConfigError, match="unknown method 'full_ft'; choose from plate, lora, osf"):
        run_sequential(tmp_path / "a", ["full_ft"], seeds=1, steps=2)
    with pytest.raises(ConfigError, match="seed 1 is listed twice"):
        run_sequential(tmp_path / "b", ["lora"], seeds=[1, 1], steps=2)
    with pytest.raises(ConfigError, match="steps must be an integer >= 1"):
        run_sequential(tmp_path / "c", ["lora"], seeds=1, steps=0)
    assert not any((tmp_path / d).exists() for d in "abc")


def test_sequential_resumes_and_never_overwrites_other_settings(tmp_path):
    """A rerun keeps every finished (seed, method) and runs only the rest; other settings into the same OUT are
    refused instead of replacing sequential.json (it used to be rewritten from scratch, losing earlier methods)."""
    from plate_inspect.experiments.sequential_tasks import run_sequential

    fresh = run_sequential(tmp_path / "ref", ["lora", "osf"], seeds=1, steps=5)
    out = tmp_path / "out"
    first = run_sequential(out, ["lora"], seeds=1, steps=5)
    events = []
    second = run_sequential(out, ["lora", "osf"], seeds=1, steps=5, progress=events.append)
    # Adam steps: lora kept (its tasks 2-4 open as done), osf ran (task 1 retrained for it, then its tasks 2-4)
    assert events[0].done == 3 * 5 and events[-1].done == events[-1].total == 3 * 5 + 5 + 3 * 5
    assert [r for r in second.records if r.method == "lora"] == first.records
    assert second.matrix("lora") == fresh.matrix("lora") and second.matrix("osf") == fresh.matrix("osf")
    before = (out / "sequential.json").read_text()
    with pytest.raises(ConfigError, match=r"other settings \(steps \(CLI: --steps\): 5 -> 6\)"):
        run_sequential(out, ["lora"], seeds=1, steps=6)
    assert (out / "sequential.json").read_text() == before


def _old_style_sequential_json(out, data="digits", steps=2):
    """sequential.json as written before session 13: settings without "data", every record in this one file (seed 0
    lora complete: 10 (after task, task) pairs; seed 0 osf torn after task 2), no OUT/seed<N>/<method>/ files."""
    pairs = [(t, j) for t in range(1, 5) for j in range(1, t + 1)]
    lora = [
        {
            "method": "lora",
            "seed": 0,
            "data": data,
            "steps": steps,
            "after_task": t,
            "task": j,
            "accuracy": 0.5 + 0.01 * (4 * t + j),
            "trainable_params": 1344,
        }  # fmt: skip
        for t, j in pairs
    ]
    osf = [dict(r, method="osf", trainable_params=1347) for r in lora[:3]]
    payload = {
        "protocol": "2v3 -> 4v5 -> 6v7 -> 8v9, merge after each task (PLATE: merge + rescan)",
        "settings": {"r": 8, "tau": 0.98, "lora_rank": 1, "osf_n": 1, "rho": 0.5, "steps": steps},
        "records": lora + osf,
        "matrices": {},
    }
    out.mkdir()
    (out / "sequential.json").write_text(json.dumps(payload, indent=2) + "\n")
    return lora


def test_sequential_resumes_an_old_sequential_json_without_a_data_setting(tmp_path):
    """Old files have no "data" in their settings and were refused as "other settings"; the missing key now reads as
    the data their records name, and their finished (seed, method) runs are kept (the hand-written accuracies come
    back unchanged, nothing trains); an incomplete one reruns. Records of another data set are still refused."""
    from plate_inspect.experiments.sequential_tasks import run_sequential

    out = tmp_path / "old"
    lora = _old_style_sequential_json(out)
    events = []
    result = run_sequential(out, ["lora"], seeds=1, steps=2, progress=events.append)
    assert [(e.done, e.total) for e in events] == [(3 * 2, 3 * 2)]  # kept: nothing ran (its tasks 2-4's steps)
    assert [json.loads(json.dumps(r.__dict__)) for r in result.records] == lora
    written = json.loads((out / "sequential.json").read_text())
    assert written["settings"]["data"] == "digits" and written["records"] == lora
    assert not (out / "seed0" / "task1.safetensors").exists()  # no stage 1 trained
    assert not (out / "seed0" / "osf" / "records.json").exists()  # the torn osf run is not taken as finished
    other = tmp_path / "fm"
    _old_style_sequential_json(other, data="fashion-mnist")
    with pytest.raises(ConfigError, match=r'other settings \(data \(CLI: --data\): "fashion-mnist" -> "digits"\)'):
        run_sequential(other, ["lora"], seeds=1, steps=2)
    with pytest.raises(ConfigError, match=r"other settings \(steps \(CLI: --steps\): 2 -> 3\)"):
        run_sequential(tmp_path / "old", ["lora"], seeds=1, steps=3)


def test_sequential_report_only_rebuilds_from_finished_runs(tmp_path):
    """experiment sequential had no --report-only (continual has): a report of an interrupted run, or of some methods
    or seeds, meant rerunning. Now it rewrites sequential.json from the finished (seed, method) runs without training:
    all of them give back the run's own file byte for byte; --methods/--seeds select (oracle: the run's records
    filtered by hand, the matrix = 100 x accuracy with one seed); what it cannot honour is one line naming it."""
    from plate_inspect.experiments.sequential_tasks import run_sequential

    out = tmp_path / "out"
    run_sequential(out, ["lora", "osf"], seeds=2, steps=2)
    full = (out / "sequential.json").read_text()
    units = {p: p.read_bytes() for p in out.glob("seed*/*/records.json")}
    assert len(units) == 4
    runner = CliRunner()
    args = ["experiment", "sequential", "--out", str(out), "--report-only"]

    def reported(*extra):
        result = runner.invoke(cli, [*args, *extra])
        assert result.exit_code == 0, result.output
        return result.output, json.loads((out / "sequential.json").read_text())

    assert reported("--steps", "2", "--data", "digits")[1] == json.loads(full)  # OUT's own settings: accepted
    assert (out / "sequential.json").read_text() == full
    output, osf = reported("--methods", "osf", "--seeds", "1")
    records = [r for r in json.loads(full)["records"] if (r["method"], r["seed"]) == ("osf", 0)]
    assert osf["records"] == records and list(osf["matrices"]) == ["osf"]
    by_pair = {(r["after_task"], r["task"]): 100 * r["accuracy"] for r in records}
    assert osf["matrices"]["osf"] == [[by_pair.get((t, j)) for j in range(1, 5)] for t in range(1, 5)]
    assert "osf: accuracy" in output and "lora: accuracy" not in output
    for extra, message in (
        (["--methods", "plate"], "has no finished run of method plate (--methods); finished: lora, osf"),
        (["--seeds", "3"], "has no finished run of seed 2 (--seeds); finished: 0, 1"),
        (["--quick"], "--report-only trains nothing, so --quick cannot apply"),
        (["--data-root", str(tmp_path)], "so --data-root cannot apply"),
        (["--steps", "5"], "its runs were made with --steps 2, not 5; drop --steps"),
        (["--data", "fashion-mnist"], "its runs were made with --data digits, not fashion-mnist"),
    ):
        bad = runner.invoke(cli, [*args, *extra])
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output, (extra, bad.output)
        assert len(bad.output.strip().splitlines()) == 1
    (out / "seed1" / "osf" / "records.json").unlink()  # as if interrupted before seed 1's osf finished
    _, partial = reported()
    assert partial["records"] == [r for r in json.loads(full)["records"] if (r["method"], r["seed"]) != ("osf", 1)]
    assert all(p.read_bytes() == b for p, b in units.items() if p.exists())  # a report never touches finished runs
    assert not (out / "seed1" / "osf" / "records.json").exists()
    run = ["experiment", "sequential", "--out", str(out), "--methods", "lora", "--seeds", "1", "--steps", "2", "-q"]
    kept = runner.invoke(cli, run)  # a run of part of OUT (kept: nothing trains) says what its report leaves out
    assert kept.exit_code == 0 and "also holds 2 finished runs of other --methods or --seeds" in kept.output
    bad = runner.invoke(cli, ["experiment", "sequential", "--out", str(tmp_path / "none"), "--report-only"])
    assert bad.exit_code == 2 and "no sequential.json here; run `plate-inspect experiment sequential" in bad.output


def test_sequential_report_only_keeps_an_old_sequential_json(tmp_path):
    """A report of an OUT written before session 13 (every record in sequential.json) keeps its complete runs, as a
    resume does, instead of rewriting the file without them; nothing trains."""
    out = tmp_path / "old"
    lora = _old_style_sequential_json(out)
    result = CliRunner().invoke(cli, ["experiment", "sequential", "--out", str(out), "--report-only", "-q"])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "sequential.json").read_text())
    assert (
        written["records"] == lora and written["settings"]["data"] == "digits" and list(written["matrices"]) == ["lora"]
    )
    assert not (out / "seed0" / "task1.safetensors").exists()


def test_sequential_unwritable_output_is_a_one_line_error(tmp_path):
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    (tmp_path / "seed0").write_text("in the way")
    args = ["experiment", "sequential", "--out", str(tmp_path), "--methods", "lora", "--seeds", "1", "--steps", "2"]
    bad = CliRunner().invoke(cli, [*args, "-q"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output, bad.output
    assert "seed0 is a file, not a directory" in bad.output and "choose another --out" in bad.output


def test_dead_unit_benchmark_pools_rows_instead_of_counting_modules_without_dead_rows():
    """benchmarks/arena_dead_units.py: 'of B's dead rows, the fraction live on task 2' used to average per-module
    fractions and count a module with no dead row in B as 1.0 (a B with 2 dead rows, none live on task 2, in one of
    three modules printed 0.67). Now rows are pooled: hand-counted masks are the oracle."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "arena_dead_units.py"
    spec = importlib.util.spec_from_file_location("arena_dead_units", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    t = torch.tensor
    live1 = {
        "fc1": t([True, True, True, True]),
        "fc2": t([False, False, True, True]),
        "fc3": t([False, True, False, True]),
    }
    live2 = {
        "fc1": t([True, True, True, True]),
        "fc2": t([False, False, True, True]),
        "fc3": t([True, True, False, True]),
    }
    b = {"fc1": t([0, 1]), "fc2": t([0, 1]), "fc3": t([0, 2])}
    # fc1: no dead row; fc2: rows 0, 1 dead on task 1, neither live on task 2; fc3: rows 0, 2 dead, row 0 live on 2
    assert bench.dead_and_revived(live1, live2, b) == (4, 1)
    assert bench.dead_and_revived(live1, live2, {"fc1": t([2, 3])}) == (0, 0)


@pytest.mark.parametrize(
    ("script", "args"), [("arena_dead_units.py", ["--seeds", "0"]), ("arena_gn_share.py", ["--probes", "0"])]
)
def test_arena_benchmarks_refuse_zero_counts_up_front(script, args):
    """--seeds 0 printed an empty table; --probes 0 trained three stage-1 models before failing on no probes."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / script
    run = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    message = f"Invalid value for '{args[0]}': 0 is not in the range x>=1"
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stdout + run.stderr
