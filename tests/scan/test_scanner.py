"""The streaming scanner end to end, against dense oracles computed from safetensors' own loader; rescans of
damaged or missing part files, and the one-line reprs of a scan plan and a checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from oracles import assert_same_bundle, dense_oracle, load_all
from safetensors.torch import load_file, save_file

import plate_inspect
import plate_inspect.scanner as scanner_mod
from plate_inspect import Bundle, verify
from plate_inspect.checkpoint import Checkpoint

R, TAU, MAX_RANK = 8, 0.9, 48


def sha256_of(stored: torch.Tensor) -> str:
    """Oracle fingerprint: sha256 of the tensor's bytes as safetensors' own loader returns them."""
    return "sha256:" + hashlib.sha256(stored.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_bundle_against_oracle(bundle: Bundle, tensors: dict[str, torch.Tensor], conv1d: bool = False, r=R):
    for rec in bundle:
        stored = tensors[rec.name + ".weight"]
        w = (stored.T if conv1d else stored).double().numpy()
        scores, b, evals, k, gram = dense_oracle(w, r, TAU, MAX_RANK)
        assert rec.shape == list(w.shape)
        assert rec.fingerprint == sha256_of(stored)
        assert bundle.b_idx(rec.name).tolist() == b.tolist(), rec.name
        assert rec.k == k, rec.name
        np.testing.assert_allclose(bundle.redundancy(rec.name).numpy(), scores, rtol=1e-4, atol=1e-5)
        q = bundle.q(rec.name, torch.float64).numpy()
        assert q.shape == (w.shape[1], k)
        np.testing.assert_allclose(q.T @ q, np.eye(k), atol=2e-5)
        energy = np.trace(q.T @ gram @ q) / evals.sum()
        assert energy == pytest.approx(evals[:k].sum() / evals.sum(), abs=1e-5)
        assert rec.captured_energy == pytest.approx(energy, abs=1e-5)
        for t, kt in rec.k_by_tau.items():
            desc = evals[::-1]
            m = int(np.argmax(np.cumsum(desc) >= float(t) * desc.sum())) + 1
            assert kt == max(1, min(w.shape[1] - m, MAX_RANK))


def test_sharded_bf16_qwen2(tmp_path, qwen_ckpt):
    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R, tau=TAU, max_rank=MAX_RANK)
    assert bundle.manifest.complete
    assert len(bundle) == 14 and {r.module_type for r in bundle} == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }
    assert all(r.dtype == "BF16" and r.layout == "linear" for r in bundle)
    check_bundle_against_oracle(bundle, load_all(qwen_ckpt.path))
    # B picks only planted near-duplicate rows (or all of them, when r exceeds their number)
    for name, rows in qwen_ckpt.planted_rows.items():
        overlap = set(rows) & set(bundle.b_idx(name).tolist())
        assert len(overlap) == min(R, len(rows)), name
    stats = bundle.stats()
    assert stats["bytes_read"] == sum(
        t.numel() * t.element_size() for n, t in load_all(qwen_ckpt.path).items() if n[:-7] in bundle
    )


def test_gpt2_conv1d_is_transposed(tmp_path, gpt2_ckpt):
    bundle = plate_inspect.scan(gpt2_ckpt.path, tmp_path / "b", r=R, tau=TAU, max_rank=MAX_RANK)
    rec = bundle.record("h.0.attn.c_attn")
    assert rec.layout == "conv1d" and rec.shape == [144, 48]
    assert rec.module_type == "attn.c_attn"
    check_bundle_against_oracle(bundle, load_all(gpt2_ckpt.path), conv1d=True)


def test_bert_layout(tmp_path, bert_ckpt):
    bundle = plate_inspect.scan(bert_ckpt.path, tmp_path / "b", r=R, tau=TAU, max_rank=MAX_RANK)
    assert "bert.pooler.dense" not in bundle and len(bundle) == 12
    assert bundle.record("bert.encoder.layer.1.output.dense").module_type == "output.dense"
    assert bundle.record("bert.encoder.layer.1.attention.output.dense").module_type == "attention.output.dense"
    check_bundle_against_oracle(bundle, load_all(bert_ckpt.path))


def test_real_minilm(tmp_path, minilm_dir):
    bundle = plate_inspect.scan(minilm_dir, tmp_path / "b", r=64, tau=0.9, max_rank=512, layers=[0, 5])
    assert len(bundle) == 12
    tensors = load_all(minilm_dir)
    for rec in bundle:
        w = tensors[rec.name + ".weight"].double().numpy()
        _, b, evals, k, gram = dense_oracle(w, 64, 0.9, 512)
        assert rec.k == k and bundle.b_idx(rec.name).tolist() == b.tolist()
        q = bundle.q(rec.name, torch.float64).numpy()
        assert np.trace(q.T @ gram @ q) / evals.sum() == pytest.approx(evals[:k].sum() / evals.sum(), abs=1e-5)
    # wide output.dense (384 x 1536): Q lies in the frozen rows' null space, capturing no energy
    assert bundle.record("encoder.layer.0.output.dense").captured_energy < 1e-6


def test_options_layers_targets_precision_qdtype(tmp_path, qwen_ckpt):
    b = plate_inspect.scan(
        qwen_ckpt.path,
        tmp_path / "a",
        r=R,
        layers=[1],
        target_modules=["q_proj", r"mlp\.down.*"],
        precision="float64",
        q_dtype="bfloat16",
    )
    assert b.modules == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    assert b.q(b.modules[0], dtype=None).dtype == torch.bfloat16
    assert b.settings.precision == "float64"
    report = verify(b, qwen_ckpt.path)  # the default tolerance follows Q's stored dtype
    assert report.ok, report.problems


def test_deterministic_bit_identical(tmp_path, qwen_ckpt):
    a = plate_inspect.scan(qwen_ckpt.path, tmp_path / "a", r=R)
    b = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R)
    files = sorted(p.name for p in a.path.iterdir() if p.name != "scan_stats.json")
    assert files == sorted(p.name for p in b.path.iterdir() if p.name != "scan_stats.json")
    for name in files:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name


def test_rescan_of_finished_bundle_is_a_no_op_and_other_settings_refuse(tmp_path, qwen_ckpt):
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=R)
    before = (out / "manifest.json").read_bytes()
    plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert (out / "manifest.json").read_bytes() == before
    with pytest.raises(plate_inspect.BundleError, match=f"other settings \\(r {R} there, {R + 1} here\\).*--overwrite"):
        plate_inspect.scan(qwen_ckpt.path, out, r=R + 1)
    b = plate_inspect.scan(qwen_ckpt.path, out, r=R + 1, overwrite=True)
    assert b.settings.r == R + 1


_KILLER = textwrap.dedent(
    """
    import os, signal, sys, time
    import plate_inspect

    src, out, after, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def killer(event):
        if event.done == after:
            if how == "kill":  # the finished part is written by a second thread: kill once it is on disk
                deadline = time.monotonic() + 60
                while not os.path.exists(os.path.join(out, "layer-00000.safetensors")) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyboardInterrupt  # (an interrupt waits for that write itself)

    plate_inspect.scan(src, out, r=8, progress=killer)
    """
)


@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_resume_after_kill_gives_identical_bundle(tmp_path, qwen_ckpt, how):
    reference = plate_inspect.scan(qwen_ckpt.path, tmp_path / "ref", r=R)
    out = tmp_path / "resumed"
    script = tmp_path / "killer.py"
    script.write_text(_KILLER)
    # die in the middle of layer 1 (module 10 of 14): layer 0's part is already written
    proc = subprocess.run(
        [sys.executable, str(script), str(qwen_ckpt.path), str(out), "10", how], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    partial = Bundle.load(out, require_complete=False)  # finished modules come from the part headers
    assert partial.modules == [n for n in reference.modules if ".layers.0." in n]
    assert (out / "layer-00000.safetensors").exists() and not (out / "layer-00001.safetensors").exists()
    with pytest.raises(plate_inspect.BundleError, match="incomplete"):
        Bundle.load(out)
    resumed = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert resumed.stats()["modules_resumed"] == 7
    for p in reference.path.iterdir():
        if p.name != "scan_stats.json":
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_rerun_removes_the_temp_files_a_killed_writer_left_and_nothing_else(tmp_path, qwen_ckpt):
    """A SIGKILL during a part or manifest write leaves its '.NAME.<hex>.tmp' (up to a part's size): the next scan
    into the directory, holding its lock, removes those; another program's temp file and other files stay."""
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=R)
    left = [
        ".layer-00001.safetensors.0123456789ab.tmp",
        ".manifest.json.a1b2c3d4e5f6.tmp",
        ".scan_stats.json.ffffffffffff.tmp",
    ]
    kept = [".report.html.0123456789ab.tmp", ".layer-00001.safetensors.notmine.tmp", "notes.txt"]
    for name in left + kept:
        (out / name).write_bytes(b"x" * 100)
    plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert sorted(p.name for p in out.iterdir() if p.name in left + kept) == sorted(kept)
    with pytest.raises(plate_inspect.BundleError, match="other settings"):  # a refused scan touches nothing
        (out / left[0]).write_bytes(b"x")
        plate_inspect.scan(qwen_ckpt.path, out, r=R + 1)
    assert (out / left[0]).exists()


def test_failed_part_write_stops_the_scan_with_its_error_and_keeps_finished_parts(tmp_path, qwen_ckpt, monkeypatch):
    # parts are written by a second thread: its error must surface, and a rerun resumes from what it wrote
    from plate_inspect.bundle import BundleWriter
    from plate_inspect.errors import BundleError

    original = BundleWriter.write_part

    def write_first_part_only(self, part, records, tensors):
        if part != "layer-00000.safetensors":
            raise BundleError(f"{part}: no space left on device")
        original(self, part, records, tensors)

    out = tmp_path / "b"
    monkeypatch.setattr(BundleWriter, "write_part", write_first_part_only)
    with pytest.raises(BundleError, match="layer-00001.safetensors: no space left"):
        plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert (out / "layer-00000.safetensors").exists() and not (out / "layer-00001.safetensors").exists()
    monkeypatch.setattr(BundleWriter, "write_part", original)
    resumed = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert resumed.stats()["modules_resumed"] == 7 and len(resumed) == 14


def test_upcast_buffer_reuses_one_block_grown_to_the_largest_weight():
    buffer = scanner_mod.UpcastBuffer()
    gen = torch.Generator().manual_seed(3)
    small, large = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in ((6, 5), (9, 8)))
    a = buffer.upcast(small, torch.float32)
    assert torch.equal(a, small.float()) and a.is_contiguous()
    b = buffer.upcast(large.T, torch.float32)  # a transposed view (GPT-2 Conv1D layout) comes out contiguous
    assert torch.equal(b, large.T.float()) and b.is_contiguous()
    c = buffer.upcast(small, torch.float32)  # smaller again: the same block, no new allocation
    assert c.data_ptr() == b.data_ptr() and torch.equal(c, small.float())
    assert buffer.upcast(small, torch.float64).dtype == torch.float64


def test_verify_detects_other_weights(tmp_path, qwen_ckpt):
    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R)
    assert verify(bundle, qwen_ckpt.path).ok
    other = plate_inspect.testing.synthetic.write_llama_like(tmp_path / "other", layers=2, seed=1)
    report = verify(bundle, other.path)
    assert not report.ok and len(report.problems) == 14
    assert "fingerprint" in report.problems[0]


def test_verify_flags_a_bundle_read_with_another_layout(tmp_path, gpt2_ckpt):
    """GPT-2's file scanned without its config.json (no model_type: Conv1D weights taken as [out, in]): the
    fingerprints match the real checkpoint, but shape/layout do not; verify (and --exact) report it, no crash."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(gpt2_ckpt.path / "model.safetensors", bare / "model.safetensors")
    bundle = plate_inspect.scan(bare, tmp_path / "b", r=4, target_modules=["c_attn", "c_fc"])
    assert all(bundle.record(n).layout == "linear" for n in bundle.manifest.modules)
    for exact in (False, True):
        report = verify(bundle, gpt2_ckpt.path, exact=exact)
        assert not report.ok and len(report.problems) == len(bundle.manifest.modules)
        assert all("(conv1d)" in p and "(linear)" in p and "rescan" in p for p in report.problems)
    assert verify(bundle, bare).ok


def test_verify_notes_a_checkpoint_of_another_model_type(tmp_path, qwen_ckpt):
    """The same weights under a config of another model_type: verified (the fingerprints match), with a note."""
    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R)
    relabelled = tmp_path / "as-llama"
    shutil.copytree(qwen_ckpt.path, relabelled)
    config = json.loads((relabelled / "config.json").read_text())
    config["model_type"] = "llama"
    (relabelled / "config.json").write_text(json.dumps(config))
    assert verify(bundle, qwen_ckpt.path).notes == []
    report = verify(bundle, relabelled)
    assert report.ok and len(report.notes) == 1
    assert "'llama'" in report.notes[0] and "'qwen2'" in report.notes[0]
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    result = CliRunner().invoke(cli, ["verify", str(bundle.path), str(relabelled)])
    assert result.exit_code == 0 and "note" in result.output and "llama" in result.output, result.output


def test_hub_repo_id_resolves_from_local_cache_offline(tmp_path, qwen_ckpt, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-qwen" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    for f in qwen_ckpt.path.iterdir():
        (snap / f.name).symlink_to(f)
    (cache / "models--acme--tiny-qwen" / "refs").mkdir()
    (cache / "models--acme--tiny-qwen" / "refs" / "main").write_text(snap.name)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = (
        "import plate_inspect,sys; b=plate_inspect.scan('acme/tiny-qwen', sys.argv[1], r=8); "
        "print(b.manifest.source['kind'], b.manifest.source['id'], b.manifest.source['commit'], len(b))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hub", "acme/tiny-qwen", snap.name, "14"]
    # a repo that is not cached: one clear line that names what is missing and how to fetch it
    code = "import plate_inspect,sys; plate_inspect.scan('acme/absent', sys.argv[1])"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "acme/absent" in out.stderr and "hf download acme/absent" in out.stderr


# --------------------------------------------------------------------------- identity: a bundle never goes stale
def change_one_weight(src, dst, module: str, scale: float = 1.5) -> None:
    """A copy of a checkpoint dir with one weight's values changed, every name, dtype, shape and offset unchanged."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][f"{module}.weight"]
    tensors = load_file(str(shard))
    tensors[f"{module}.weight"] = (tensors[f"{module}.weight"].float() * scale).to(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.fixture
def geometry_calls(monkeypatch):
    """Names of the modules the scanner computes (a spy around the real plate_geometry, nothing replaced)."""
    seen: list[int] = []
    real = scanner_mod.plate_geometry

    def spy(weight, *args, **kwargs):
        seen.append(tuple(weight.shape))
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(scanner_mod, "plate_geometry", spy)
    return seen


def test_rescan_after_weights_change_recomputes_exactly_the_changed_module(tmp_path, qwen_ckpt, geometry_calls):
    changed = "model.layers.1.mlp.up_proj"
    model = tmp_path / "model"
    shutil.copytree(qwen_ckpt.path, model)
    out = tmp_path / "b"
    plate_inspect.scan(model, out, r=R, max_rank=MAX_RANK)
    assert len(geometry_calls) == 14
    layer0 = (out / "layer-00000.safetensors").stat().st_ino
    before = Checkpoint.open(model).signature()
    shutil.rmtree(model)
    change_one_weight(qwen_ckpt.path, model, changed)
    assert Checkpoint.open(model).signature() == before  # the layout is the same: only the content tells

    geometry_calls.clear()
    rescanned = plate_inspect.scan(model, out, r=R, max_rank=MAX_RANK)
    assert geometry_calls == [(176, 64)]  # one up_proj computed, nothing else
    stats = rescanned.stats()
    assert (stats["modules_scanned"], stats["modules_changed"], stats["modules_resumed"]) == (1, 1, 13)
    assert stats["bytes_read"] == sum(
        t.numel() * t.element_size() for n, t in load_all(model).items() if n[:-7] in rescanned
    )
    assert (out / "layer-00000.safetensors").stat().st_ino == layer0  # an unchanged part is not rewritten
    assert rescanned.record(changed).fingerprint == sha256_of(load_all(model)[f"{changed}.weight"])
    check_bundle_against_oracle(rescanned, load_all(model))
    assert verify(rescanned, model).ok

    fresh = plate_inspect.scan(model, tmp_path / "fresh", r=R, max_rank=MAX_RANK)
    assert_same_bundle(out, fresh.path)
    assert rescanned.manifest.identity == fresh.manifest.identity != ""


def test_rescan_of_unchanged_weights_computes_nothing_and_reads_each_weight_once(tmp_path, qwen_ckpt, geometry_calls):
    out = tmp_path / "b"
    first = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    inodes = {p.name: p.stat().st_ino for p in out.glob("*.safetensors")}
    geometry_calls.clear()
    again = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert geometry_calls == []
    stats = again.stats()
    assert (stats["modules_scanned"], stats["modules_changed"], stats["modules_resumed"]) == (0, 0, 14)
    targets = sum(t.numel() * t.element_size() for n, t in load_all(qwen_ckpt.path).items() if n[:-7] in again)
    assert stats["bytes_read"] == targets  # the check is one read of every target weight, nothing more
    assert {p.name: p.stat().st_ino for p in out.glob("*.safetensors")} == inodes
    assert again.manifest.to_json() == first.manifest.to_json()


def test_identity_covers_every_module_fingerprint_and_the_settings(tmp_path, qwen_ckpt):
    a = plate_inspect.scan(qwen_ckpt.path, tmp_path / "a", r=R)
    m = a.manifest
    stored = load_all(qwen_ckpt.path)
    fingerprints = sorted(
        [n, sha256_of(stored[n + ".weight"]), "BF16", [*stored[n + ".weight"].shape], "linear"] for n in a.modules
    )
    # the settings as format v1 first wrote them (no include_mtp key): bundles made before it keep their identity
    v1_settings = {
        "r": R, "tau": 0.9, "max_rank": 512, "seed": 0, "sketch_dim": None, "anchors": 256, "target_modules": None,
        "layers": None, "precision": "float32", "q_dtype": "float32",
        "tau_grid": [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99],
    }  # fmt: skip
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["config"] == {**v1_settings, "include_mtp": False}
    oracle = {"settings": v1_settings, "variant": None, "modules": fingerprints}
    expected = "sha256:" + hashlib.sha256(json.dumps(oracle, sort_keys=True).encode()).hexdigest()
    assert m.identity == expected
    b = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R, seed=1)
    assert b.manifest.identity != m.identity


def test_scan_stats_record_blas_thread_pools(tmp_path, qwen_ckpt):
    from threadpoolctl import threadpool_info

    stats = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R, layers=[0]).stats()
    pools = {(p["internal_api"], p["prefix"]): p["num_threads"] for p in threadpool_info()}
    recorded = {(p["internal_api"], p["prefix"]): p["num_threads"] for p in stats["blas_threads"]}
    assert recorded and recorded.items() <= pools.items()
    assert any(api in ("openblas", "mkl", "blis") for api, _ in recorded)  # the BLAS numpy/scipy use
    assert stats["torch_threads"] == torch.get_num_threads()


@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
def test_verify_accepts_rounded_q_and_flags_a_bent_one(tmp_path, qwen_ckpt, q_dtype):
    """A half-precision Q is orthonormal to its own rounding (bf16: |Q^T Q - I| up to ~eps = 7.8e-3): the CLI's
    verify accepts it with no tolerance to pass; a Q with one column stretched by 10% is still refused."""
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    out = tmp_path / "b"
    b = plate_inspect.scan(qwen_ckpt.path, out, r=R, q_dtype=q_dtype)
    worst = max(
        float(
            (b.q(n, torch.float64).T @ b.q(n, torch.float64) - torch.eye(b.record(n).k, dtype=torch.float64))
            .abs()
            .max()
        )
        for n in b.modules
    )
    assert worst < torch.finfo(getattr(torch, q_dtype)).eps  # rounding's own bound (the Cauchy-Schwarz one: eps)
    if q_dtype == "bfloat16":
        assert worst > 1e-3  # the former fixed tolerance 1e-3 refused these bundles
    res = CliRunner().invoke(cli, ["verify", str(out), str(qwen_ckpt.path)])
    assert res.exit_code == 0, res.output
    name = "model.layers.1.self_attn.o_proj"
    part = out / b.record(name).file
    tensors = load_file(part)
    q = tensors[f"{name}.plate_Q"].clone()
    q[:, 0] *= 1.1  # |Q^T Q - I|_00 = 0.21
    tensors[f"{name}.plate_Q"] = q
    save_file(tensors, part, metadata={"format": "pt"})
    report = verify(out, qwen_ckpt.path)
    assert all(name in p for p in report.problems)
    assert ["not orthonormal" in p for p in report.problems] == [True, False]  # then the digest's own complaint
    res = CliRunner().invoke(cli, ["verify", str(out), str(qwen_ckpt.path)])
    assert res.exit_code == 1 and "not orthonormal" in res.output


def test_verify_catches_swapped_or_bit_flipped_geometry(tmp_path, qwen_ckpt):
    """Every record carries a digest of its B and Q as written; Q's swapped between two same-shaped modules (each
    still orthonormal, so structure checks pass) and a single flipped low bit are both caught."""
    out = tmp_path / "b"
    b = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    for name in b.modules:  # the digest's definition, computed here independently
        h = hashlib.sha256(b.b_idx(name).numpy().astype("<i8").tobytes())
        q = b.q(name, dtype=None).float().contiguous()
        h.update(b"float32" + str(list(q.shape)).encode() + q.numpy().astype("<f4").tobytes())
        assert b.record(name).geometry_digest == "sha256:" + h.hexdigest()
    assert verify(out, qwen_ckpt.path).ok
    v0, v1 = next(  # two modules of equal Q shape in different part files: a swap passes every structure check
        (m, n)
        for m in b.modules
        for n in b.modules
        if b.record(m).file < b.record(n).file and b.q(m).shape == b.q(n).shape
    )
    p0, p1 = out / b.record(v0).file, out / b.record(v1).file
    t0, t1 = load_file(p0), load_file(p1)
    meta0, meta1 = _part_metadata(p0), _part_metadata(p1)
    t0[f"{v0}.plate_Q"], t1[f"{v1}.plate_Q"] = t1[f"{v1}.plate_Q"].clone(), t0[f"{v0}.plate_Q"].clone()
    save_file(t0, p0, metadata=meta0)
    save_file(t1, p1, metadata=meta1)
    problems = verify(out, qwen_ckpt.path).problems
    assert len(problems) == 2 and all("B or Q differ" in p for p in problems), problems
    assert {v0, v1} == {n for n in (v0, v1) for p in problems if f"'{n}'" in p}
    plate_inspect.scan(qwen_ckpt.path, out, r=R, overwrite=True)
    q_name = "model.layers.0.mlp.up_proj"
    part = out / b.record(q_name).file
    tensors, meta = load_file(part), _part_metadata(part)
    tensors[f"{q_name}.plate_Q"].view(torch.int32)[3, 2] ^= 1  # one ulp
    save_file(tensors, part, metadata=meta)
    problems = verify(out).problems  # structure only, no model needed
    assert len(problems) == 1 and q_name in problems[0] and "B or Q differ" in problems[0]


@pytest.mark.parametrize("kind", ["redundancy", "spectrum", "plate_Q"])
def test_damaged_part_tensors_are_flagged_and_a_rescan_repairs_them(tmp_path, qwen_ckpt, kind):
    """QA: a sign flipped in a stored redundancy score (or a spectrum bit) passed verify, and a rescan kept the
    damage ("recomputed 0"). Every stored tensor is now under a digest: verify names the module, a plain rescan
    recomputes exactly that module and the bundle is byte-identical to a fresh scan."""
    fresh = plate_inspect.scan(qwen_ckpt.path, tmp_path / "fresh", r=R)
    out = tmp_path / "b"
    shutil.copytree(fresh.path, out)
    name = "model.layers.1.self_attn.o_proj"
    part = out / fresh.record(name).file
    tensors, meta = load_file(part), _part_metadata(part)
    if kind == "redundancy":
        tensors[f"{name}.redundancy"][5] *= -1
    else:
        tensors[f"{name}.{kind}"].view(torch.int32 if tensors[f"{name}.{kind}"].element_size() == 4 else torch.int64)[
            3
        ] ^= 1
    save_file(tensors, part, metadata=meta)
    problems = verify(out).problems
    assert len(problems) == 1 and name in problems[0] and "digest mismatch" in problems[0], problems
    again = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    stats = again.stats()
    assert (stats["modules_damaged"], stats["modules_scanned"], stats["modules_resumed"]) == (1, 1, 13)
    from plate_inspect.cli.scan import reuse_line

    assert reuse_line(stats).startswith("1 module damaged in the part files")
    assert verify(out, qwen_ckpt.path).ok
    for p in sorted(fresh.path.glob("*.safetensors")):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def _part_metadata(path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_scan_of_another_model_into_a_bundle_dir_says_so(tmp_path, qwen_ckpt, monkeypatch):
    """Scanning a fine-tune into its base's bundle dir is an incremental update (documented); the CLI says that the
    dir held another model's bundle, and default output names do not collide for ``<dir>/model.safetensors``."""
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=R)
    same = CliRunner().invoke(cli, ["scan", str(qwen_ckpt.path), "--out", str(out), "--r", str(R), "-q"])
    assert same.exit_code == 0 and "note:" not in same.output
    other = plate_inspect.testing.synthetic.write_llama_like(tmp_path / "other", layers=2, seed=1)
    res = CliRunner().invoke(cli, ["scan", str(other.path), "--out", str(out), "--r", str(R), "-q"])
    assert res.exit_code == 0, res.output
    squeezed = "".join(res.output.split())  # rich folds long lines (and long paths) at its console width
    assert f"holdsabundleof{qwen_ckpt.path};updatingitfor{other.path}" in squeezed
    assert Bundle.load(out).manifest.source["id"] == str(other.path)

    from plate_inspect.scanner import default_out_dir

    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "model.safetensors").touch()
    (tmp_path / "m2" / "finetuned.safetensors").touch()
    assert default_out_dir(tmp_path / "m2" / "model.safetensors") == default_out_dir(tmp_path / "m2")
    assert str(default_out_dir(tmp_path / "m2")) == str(Path("bundles") / "m2")
    assert default_out_dir(tmp_path / "m2" / "finetuned.safetensors") == Path("bundles") / "finetuned"
    assert default_out_dir("Qwen/Qwen2.5-7B") == Path("bundles") / "Qwen2.5-7B"
    monkeypatch.chdir(tmp_path / "m2")
    assert default_out_dir(".") == Path("bundles") / "m2"


def test_a_second_scan_into_a_directory_being_written_is_refused(tmp_path, qwen_ckpt):
    """Two scans into one --out would interleave their part files (the second with --overwrite even deletes the
    first's): the directory is locked while a scan writes, and the lock dies with its process (SIGKILL too)."""
    import fcntl
    import signal

    out = tmp_path / "b"
    out.mkdir()
    holder = os.open(out, os.O_RDONLY)  # what a running scan holds
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        for overwrite in (False, True):
            with pytest.raises(plate_inspect.BundleError, match="another scan is writing this bundle"):
                plate_inspect.scan(qwen_ckpt.path, out, r=R, overwrite=overwrite)
        assert list(out.iterdir()) == []  # nothing written, nothing deleted
    finally:
        os.close(holder)
    code = textwrap.dedent(
        f"""
        import sys, time
        from plate_inspect.bundle import BundleWriter, Manifest, ScanSettings
        BundleWriter({str(out)!r}, Manifest(source={{}}, settings=ScanSettings())).open()
        print("locked", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(plate_inspect.BundleError, match="another scan"):
            plate_inspect.scan(qwen_ckpt.path, out, r=R, overwrite=True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    b = plate_inspect.scan(qwen_ckpt.path, out, r=R, overwrite=True)  # the killed holder's lock is gone
    assert b.manifest.complete
    assert plate_inspect.scan(qwen_ckpt.path, out, r=R).manifest.identity == b.manifest.identity  # released again
    with pytest.raises(plate_inspect.BundleError, match="other settings"):  # a refusal releases the lock too
        plate_inspect.scan(qwen_ckpt.path, out, r=R + 1)
    assert plate_inspect.scan(qwen_ckpt.path, out, r=R).manifest.complete


def test_verify_notices_an_edited_manifest(tmp_path, qwen_ckpt):
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=R, layers=[0])
    data = json.loads((out / "manifest.json").read_text())
    data["modules"]["model.layers.0.mlp.up_proj"]["fingerprint"] = "sha256:" + "0" * 64
    (out / "manifest.json").write_text(json.dumps(data))
    report = verify(out)
    assert not report.ok and "identity" in report.problems[0]


def test_atomic_write_gives_the_umask_mode_and_leaves_the_umask_alone(tmp_path):
    code = (
        "import os, sys; os.umask(0o027); import plate_inspect.bundle, plate_inspect.reports, plate_inspect.scanner; "
        "from plate_inspect.atomic import atomic_write; atomic_write(sys.argv[1], 'x'); print(oct(os.umask(0o022)))"
    )
    target = tmp_path / "f.json"
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0o27"  # nothing changed the process umask, at import or while writing
    assert target.stat().st_mode & 0o777 == 0o640 and target.read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temp file left behind


def test_atomic_write_errors_name_the_target_not_the_temp_file(tmp_path, monkeypatch):
    """A failed write names the file the caller asked for (what a user can act on), not ``.f.json.<hex>.tmp``; the
    error keeps its errno (and OSError subclass), and no temp file is left behind."""
    import errno

    from plate_inspect.atomic import atomic_write

    (tmp_path / "a-file").write_text("x")
    target = tmp_path / "a-file" / "f.json"  # creating the temp file fails: its parent is a file
    with pytest.raises(NotADirectoryError) as info:
        atomic_write(target, "x")
    assert info.value.filename == str(target) and info.value.errno == errno.ENOTDIR

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the write itself fails, after the temp file exists
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "g.json", "x")
    assert info.value.filename == str(tmp_path / "g.json") and info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_cli_says_how_many_modules_changed(tmp_path, qwen_ckpt):
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    model = tmp_path / "model"
    shutil.copytree(qwen_ckpt.path, model)
    args = ["scan", str(model), "--out", str(tmp_path / "b"), "--r", "8", "--layers", "0", "--quiet"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0 and "computed 7 of 7 modules" in first.output
    shutil.rmtree(model)
    change_one_weight(qwen_ckpt.path, model, "model.layers.0.self_attn.v_proj")
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0
    assert "1 of 7 modules changed since the bundle was made: recomputed 1, kept 6" in again.output


def test_scan_settings_check_and_normalise_themselves():
    """ScanSettings is the one carrier of a scan's settings: bad values are ConfigErrors, lists become tuples."""
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.errors import ConfigError

    s = ScanSettings(tau=1 - 0.1, layers=[3, 1], target_modules=["q_proj"], tau_grid=[0.9, 0.5, 0.9], include_mtp=1)
    assert (s.layers, s.target_modules, s.tau_grid, s.include_mtp) == ((3, 1), ("q_proj",), (0.5, 0.9), True)
    assert ScanSettings.from_json(s.to_json()) == s
    for bad, match in [
        (dict(r=0), "r must be"),
        (dict(tau=1.0), "tau must"),
        (dict(precision="float16"), "precision"),
        (dict(q_dtype="int8"), "q dtype"),
        (dict(tau_grid=[0.5, 1.5]), "tau grid"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ScanSettings(**bad)


def test_read_ahead_reads_each_item_once_and_keeps_no_weight_alive(qwen_ckpt):
    """The reader yields every item's weights (equal to safetensors' own tensors) and holds none of them itself:
    once the consumer drops an item, it is freed while the next one is read (memory = one item + one ahead)."""
    import gc
    import weakref
    from contextlib import closing

    plan = scanner_mod.plan_scan(qwen_ckpt.path, plate_inspect.ScanSettings(r=R, tau=TAU, max_rank=MAX_RANK))
    items = [[t] for t in plan.targets]
    oracle = load_all(qwen_ckpt.path)
    refs = []
    with closing(scanner_mod._read_ahead(plan.checkpoint, items, pin=False)) as weights:
        for (target,) in items:
            loaded = next(weights)
            ((weight, fingerprint),) = loaded
            stored = oracle[target.tensor.name]
            assert fingerprint == sha256_of(stored)
            assert torch.equal(weight, stored)
            refs.append(weakref.ref(weight))
            del loaded, weight
            gc.collect()
            assert refs[-1]() is None, f"{target.name}: the reader still holds the weight"
        with pytest.raises(StopIteration):
            next(weights)
    assert len(refs) == len(plan.targets)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is a Linux feature")
def test_reader_thread_yields_the_cores_to_the_compute_thread(tmp_path, qwen_ckpt, monkeypatch):
    """Reading and hashing run at a higher niceness than the thread that runs the BLAS calls, so they use the
    cycles it leaves free; the main thread keeps its priority, and so does the part writer (a writer that yields
    holds its part's tensors longer: more peak memory). CI runs at niceness 0."""
    import threading

    from plate_inspect.bundle import BundleWriter

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = niceness()
    seen: dict[str, set[tuple[str, int]]] = {"read": set(), "write": set(), "compute": set()}
    load, write, geometry = scanner_mod.load_target, BundleWriter.write_part, scanner_mod.plate_geometry

    def spy(kind, fn):
        def wrapped(*args, **kwargs):
            seen[kind].add((threading.current_thread().name, niceness()))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(scanner_mod, "load_target", spy("read", load))
    monkeypatch.setattr(BundleWriter, "write_part", spy("write", write))
    monkeypatch.setattr(scanner_mod, "plate_geometry", spy("compute", geometry))
    plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R)
    expected = max(base, scanner_mod.READER_NICENESS)  # lowered to 10, never raised (a niced run stays so)
    assert {p for _, p in seen["read"]} == {expected}
    assert all(name.startswith("plate-read") for name, _ in seen["read"])
    assert {p for _, p in seen["write"]} == {base}
    assert all(name.startswith("plate-write") for name, _ in seen["write"])
    assert seen["compute"] == {(threading.main_thread().name, base)} and niceness() == base


def test_verify_exact_reports_a_broken_b_instead_of_crashing(tmp_path, qwen_ckpt):
    out = tmp_path / "b"
    b = plate_inspect.scan(qwen_ckpt.path, out, r=R, layers=[0])
    name = "model.layers.0.self_attn.q_proj"
    part = out / b.record(name).file
    tensors, meta = load_file(part), _part_metadata(part)
    tensors[f"{name}.plate_B_idx"][-1] = b.record(name).d_out  # one past the last row
    save_file(tensors, part, metadata=meta)
    report = verify(out, qwen_ckpt.path, exact=True)
    assert any("out of range" in p for p in report.problems) and name not in report.exactness
    assert len(report.exactness) == len(b) - 1 and all(c.ok for c in report.exactness.values())


def test_verify_lists_every_module_of_missing_or_truncated_parts(tmp_path, qwen_ckpt):
    """QA: a missing or truncated part stopped verify at the first one (exit 2); now each affected module is a
    problem, the intact parts are still checked, and a plain rescan restores the bundle."""
    b = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R)
    by_part: dict[str, list[str]] = {}
    for name in b.modules:
        by_part.setdefault(b.record(name).file, []).append(name)
    first, second = sorted(by_part)[:2]
    (b.path / first).unlink()
    data = (b.path / second).read_bytes()
    (b.path / second).write_bytes(data[: len(data) // 2])
    report = verify(b.path)
    assert report.modules_checked == len(b.modules) and not report.ok
    assert sorted(report.problems) == sorted(
        p for p in report.problems if any(f"'{n}" in p for n in by_part[first] + by_part[second])
    )
    assert len(report.problems) == len(by_part[first]) + len(by_part[second])
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    info = CliRunner().invoke(cli, ["info", str(b.path)])
    # info shows the manifest, then names the missing and the truncated part (session 18: exit 2, was 0)
    assert info.exit_code == 2 and f"{first} (missing)" in info.output, info.output
    assert f"{second} (file is truncated" in info.output, info.output
    plate_inspect.scan(qwen_ckpt.path, b.path, r=R)
    assert verify(b.path, qwen_ckpt.path).ok


# --------------------------------------------------------------------------- rescans: settings as resolved, resumes
def test_equivalent_setting_spellings_rescan_and_truly_different_ones_are_refused(tmp_path, geometry_calls):
    """QA: `--layers 0-2` on a 3-layer model (every layer, the default) was refused as "other settings". Selection
    settings are compared by the modules they plan: equivalent spellings rescan (nothing recomputed, the bundle
    keeps its own spelling, so its files and identity are untouched); a spelling that plans other modules, or any
    other setting, is refused as before."""
    from click.testing import CliRunner

    from plate_inspect.cli.main import cli
    from plate_inspect.targets import parse_layers

    model = plate_inspect.testing.synthetic.write_llama_like(tmp_path / "m", layers=3, hidden=32, intermediate=48).path
    layers_there = sorted({int(n.split(".")[2]) for n in load_all(model) if n.startswith("model.layers.")})
    assert layers_there == [0, 1, 2]  # the oracle: what "all layers" is for this checkpoint
    out = tmp_path / "b"
    first = plate_inspect.scan(model, out, r=R)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "scan_stats.json"}
    geometry_calls.clear()
    for layers in ([0, 1, 2], parse_layers("0-2"), parse_layers("0,1,2"), parse_layers("2,0-1,1"), [2, 1, 0, 0]):
        again = plate_inspect.scan(model, out, r=R, layers=layers)
        assert geometry_calls == [] and again.stats()["modules_resumed"] == 21, layers
        assert again.settings == first.settings and again.manifest.identity == first.manifest.identity
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "scan_stats.json"} == files
    cli_run = CliRunner().invoke(cli, ["scan", str(model), "--out", str(out), "--r", str(R), "--layers", "0-2", "-q"])
    assert cli_run.exit_code == 0, cli_run.output
    assert geometry_calls == []
    # truly different: other layers (named, with the module counts), or another r (layers spelled equivalently)
    with pytest.raises(plate_inspect.BundleError, match=r"layers None there, \(0, 1\) here; 21 modules there, 14 here"):
        plate_inspect.scan(model, out, r=R, layers=[0, 1])
    with pytest.raises(plate_inspect.BundleError, match=rf"other settings \(r {R} there, {R + 1} here\); replace"):
        plate_inspect.scan(model, out, r=R + 1, layers=[0, 1, 2])

    # target modules: order and duplicates do not matter, the modules they select do
    out = tmp_path / "t"
    picked = plate_inspect.scan(model, out, r=R, target_modules=["q_proj", "v_proj"], layers=[0, 2])
    assert len(picked) == 4
    geometry_calls.clear()
    for names, layers in [(["v_proj", "q_proj"], [2, 0]), (["v_proj", "q_proj", "v_proj"], [0, 2, 2])]:
        again = plate_inspect.scan(model, out, r=R, target_modules=names, layers=layers)
        assert geometry_calls == [] and again.settings == picked.settings
        assert again.manifest.identity == picked.manifest.identity
    with pytest.raises(plate_inspect.BundleError, match=r"target_modules \('q_proj', 'v_proj'\) there, \('q_proj',\)"):
        plate_inspect.scan(model, out, r=R, target_modules=["q_proj"], layers=[0, 2])


class _Stop(Exception):
    """Stands for Ctrl-C or a kill in the middle of a scan."""


def test_resumed_rescan_counts_the_modules_the_interrupted_run_recomputed(tmp_path, qwen_ckpt):
    """QA: a rescan of changed weights, interrupted and resumed, said "3 of 14 modules changed" counting only the
    resumed run's modules. The count is now since the bundle was made, across the interruption, and the line says
    which run recomputed what. Oracle: sha256 of the weights as safetensors loads them, before and after."""
    model = tmp_path / "model"
    shutil.copytree(qwen_ckpt.path, model)
    out = tmp_path / "b"
    plate_inspect.scan(model, out, r=R)
    shutil.rmtree(model)
    shutil.copytree(qwen_ckpt.path, model)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    for module in ("layers.0.self_attn.q_proj", "layers.0.mlp.up_proj", "layers.1.self_attn.v_proj",
                   "layers.1.mlp.gate_proj", "layers.1.mlp.down_proj"):  # fmt: skip
        shard = model / index["weight_map"][f"model.{module}.weight"]
        tensors = load_file(str(shard))
        tensors[f"model.{module}.weight"] = (tensors[f"model.{module}.weight"].float() * 1.5).to(torch.bfloat16)
        save_file(tensors, str(shard), metadata={"format": "pt"})
    before, after = load_all(qwen_ckpt.path), load_all(model)
    changed = {n[: -len(".weight")] for n in before if sha256_of(before[n]) != sha256_of(after[n])}
    changed_layer0 = {n for n in changed if ".layers.0." in n}
    assert len(changed) == 5 and len(changed_layer0) == 2

    def stop_in_layer_1(event):  # layer 0's part (7 modules) is written, layer 1 is being computed
        if event.done == 10:
            raise _Stop

    with pytest.raises(_Stop):
        plate_inspect.scan(model, out, r=R, progress=stop_in_layer_1)
    partial = Bundle.load(out, require_complete=False)
    redone = {n for n in changed if partial.record(n).fingerprint == sha256_of(after[n + ".weight"])}
    assert redone == changed_layer0  # the interrupted run recomputed layer 0's changed modules, not layer 1's
    resumed = plate_inspect.scan(model, out, r=R)
    stats = resumed.stats()
    assert stats["modules_changed"] == len(changed)
    assert stats["modules_changed_earlier"] == len(changed_layer0)
    assert (stats["modules_scanned"], stats["modules_resumed"], stats["resumed"]) == (3, 11, True)
    from plate_inspect.cli.scan import reuse_line

    assert reuse_line(stats) == (
        "resumed an interrupted rescan: 5 of 14 modules changed since the bundle was made; recomputed 2 in the "
        "interrupted run and 3 in this one, kept 9 unchanged"
    )
    assert "rescan_baseline" not in json.loads((out / "manifest.json").read_text())  # finished: no baseline left
    fresh = plate_inspect.scan(model, tmp_path / "fresh", r=R)
    assert_same_bundle(out, fresh.path)
    # a finished rescan of the finished bundle: nothing changed since it was made
    again = plate_inspect.scan(model, out, r=R).stats()
    assert (again["modules_changed"], again["modules_scanned"], again["resumed"]) == (0, 0, False)


def test_a_bundle_with_every_module_written_but_not_finalised_says_so(tmp_path, qwen_ckpt, monkeypatch, geometry_calls):
    """QA: a scan stopped after its last part but before the manifest was marked complete was described as
    "incomplete (14/14 modules)" by info, verify and scan. They now say that every module is written and the bundle
    is not finalised, and that rerunning the same scan finishes it (recomputing nothing)."""
    from click.testing import CliRunner

    from plate_inspect.bundle import BundleWriter
    from plate_inspect.cli.main import cli

    def killed_before_the_manifest(self, stats=None):
        raise _Stop

    out = tmp_path / "b"
    monkeypatch.setattr(BundleWriter, "finalize", killed_before_the_manifest)
    with pytest.raises(_Stop):
        plate_inspect.scan(qwen_ckpt.path, out, r=R)
    monkeypatch.undo()
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert len(list(out.glob("layer-*.safetensors"))) == 2  # every part is there
    for call in (lambda: Bundle.load(out), lambda: verify(out)):
        with pytest.raises(plate_inspect.BundleError) as err:
            call()
        assert "all 14 modules are written" in str(err.value) and "not finalised" in str(err.value)
        assert "rerun the same scan command to finish it" in str(err.value) and "14/14" not in str(err.value)
    runner = CliRunner()
    info = runner.invoke(cli, ["info", str(out)])
    assert info.exit_code == 0 and "all 14 modules written, not finalised" in info.output, info.output
    assert "14/14" not in info.output and "incomplete" not in info.output.lower()
    checked = runner.invoke(cli, ["verify", str(out)])
    assert checked.exit_code == 2 and "error:" in checked.output and "not finalised" in checked.output
    other = runner.invoke(cli, ["scan", str(qwen_ckpt.path), "--out", str(out), "--r", str(R + 1), "-q"])
    assert (
        other.exit_code == 2
        and "holds an unfinished (all 14 modules written, not finalised) bundle made with "
        "other settings (r 8 there, 9 here)"
        in " ".join(other.output.split())
    ), other.output
    geometry_calls.clear()
    finished = runner.invoke(cli, ["scan", str(qwen_ckpt.path), "--out", str(out), "--r", str(R), "-q"])
    assert finished.exit_code == 0, finished.output
    assert "finished an interrupted scan: all 14 modules were already written" in " ".join(finished.output.split())
    assert geometry_calls == [] and Bundle.load(out).manifest.complete
    # a scan stopped halfway still says how far it got
    (out / "layer-00001.safetensors").unlink()
    data = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**data, "complete": False, "modules": {}, "identity": ""}))
    with pytest.raises(plate_inspect.BundleError, match="incomplete: 7 of 14 modules written.*resume it"):
        Bundle.load(out)


def test_resumed_fresh_scan_does_not_claim_a_finished_bundle_changed(tmp_path, qwen_ckpt):
    """An interrupted first scan, resumed after one weight changed: no finished bundle existed, so the line says
    what this run kept and computed and why, instead of "1 of 14 modules changed since the bundle was made"."""
    from plate_inspect.cli.scan import reuse_line

    model = tmp_path / "model"
    shutil.copytree(qwen_ckpt.path, model)
    out = tmp_path / "b"

    def stop_in_layer_1(event):
        if event.done == 10:
            raise _Stop

    with pytest.raises(_Stop):
        plate_inspect.scan(model, out, r=R, progress=stop_in_layer_1)
    shutil.rmtree(model)
    change_one_weight(qwen_ckpt.path, model, "model.layers.0.mlp.up_proj")
    stats = plate_inspect.scan(model, out, r=R).stats()
    assert (stats["resumed"], stats["modules_changed"], stats["modules_scanned"], stats["modules_resumed"]) == (
        True, 1, 8, 6,
    )  # fmt: skip
    assert reuse_line(stats) == (
        "resumed an interrupted scan: kept 6 finished modules, computed 8 (of 14), 1 of them because their weights "
        "changed since the interrupted run wrote them"
    )
    assert_same_bundle(out, plate_inspect.scan(model, tmp_path / "fresh", r=R).path)
    # resumed without any change: kept and computed, nothing about changes
    with pytest.raises(_Stop):
        plate_inspect.scan(model, tmp_path / "c", r=R, progress=stop_in_layer_1)
    again = plate_inspect.scan(model, tmp_path / "c", r=R).stats()
    assert reuse_line(again) == "resumed an interrupted scan: kept 7 finished modules, computed 7 (of 14)"


def test_scan_report_errors_name_what_scan_users_set(tmp_path, gpt2_ckpt, monkeypatch):
    """QA: `scan --report`'s report-write errors said "give a file name, e.g. -o <out>/report.html/report.html" or
    "choose another -o": words of `plate-inspect report`; for scan, -o is the bundle's directory. A directory in the
    report's way is now refused before the scan (nothing computed), and a failed write (disk full) says the bundle
    is complete and which command writes its report elsewhere."""
    import errno
    import os

    from click.testing import CliRunner

    from plate_inspect.cli.main import cli

    out = tmp_path / "b"
    (out / "report.html").mkdir(parents=True)
    args = ["scan", str(gpt2_ckpt.path), "--out", str(out), "--r", "4", "--max-rank", "24", "--report", "-q"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "scan --report" in res.output and f"plate-inspect report {out} -o FILE.html" in res.output
    assert "-o " + str(out / "report.html") not in res.output and not (out / "manifest.json").exists()
    (out / "report.html").rmdir()

    real_replace = os.replace

    def disk_full_for_reports(src, dst, *a, **k):  # the disk fills up just when the report is written
        if str(dst).endswith("report.html"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", disk_full_for_reports)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert "disk full" in line and f"the bundle in {out} is complete" in line and "choose another -o" not in line
    assert plate_inspect.Bundle.load(out).manifest.complete and not (out / "report.html").exists()


def test_same_model_takes_a_checkpoint_file_and_its_directory_as_one(tmp_path):
    """The rescan note ('holds a bundle of X; updating it for Y') was printed for dir/model.safetensors then dir."""
    from plate_inspect.scanner import same_model

    for d in ("m", "other"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.safetensors").write_bytes(b"x")
    local = lambda p: {"kind": "local", "id": str(p)}  # noqa: E731
    assert same_model(local(tmp_path / "m" / "model.safetensors"), local(tmp_path / "m"))
    assert same_model(local(tmp_path / "m"), local(tmp_path / "m" / "." / "model.safetensors"))
    assert same_model(local(tmp_path / "m"), local(f"{tmp_path}/other/../m"))
    assert not same_model(local(tmp_path / "m" / "model.safetensors"), local(tmp_path / "other"))
    assert not same_model(local(tmp_path / "m"), local(tmp_path / "other" / "model.safetensors"))
    assert not same_model(local(tmp_path / "m"), {"kind": "hub", "id": str(tmp_path / "m")})


def test_rescan_line_names_damaged_and_missing_part_files(tmp_path):
    """QA: a rescan that met one damaged module and a deleted part file said "1 module damaged in the part files
    (digest mismatch): recomputed 8, kept 6 of 14": the 7 modules of the missing file were not named. The line now
    names both, with counts taken from the bundle's own manifest (the deleted file's modules)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import plate_inspect
    from plate_inspect.cli.scan import reuse_line
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "ckpt", layers=2).path
    out = tmp_path / "b"
    fresh = plate_inspect.scan(ckpt, out, r=4)
    records = list(fresh)
    files = sorted({rec.file for rec in records})
    assert len(files) >= 2, files
    lost = [rec.name for rec in records if rec.file == files[1]]
    (out / files[1]).unlink()
    name = next(rec.name for rec in records if rec.file == files[0])
    with safe_open(str(out / files[0]), "pt") as f:
        meta = f.metadata()
    tensors = load_file(out / files[0])
    tensors[f"{name}.redundancy"][0] *= -1
    save_file(tensors, out / files[0], metadata=meta)
    stats = plate_inspect.scan(ckpt, out, r=4).stats()
    total = len(records)
    assert (stats["modules_damaged"], stats["modules_scanned"]) == (1, 1 + len(lost)), stats
    assert reuse_line(stats) == (
        f"1 module damaged in the part files (digest mismatch), {len(lost)} whose part files were missing or "
        f"unreadable: recomputed {1 + len(lost)}, kept {total - 1 - len(lost)} of {total}"
    )
    ref = plate_inspect.scan(ckpt, tmp_path / "ref", r=4)  # an independent scan: the repaired modules equal it
    repaired = plate_inspect.Bundle.load(out)
    for module in [name, *lost]:
        assert torch.equal(repaired.q(module), ref.q(module)), module


def test_scan_plan_and_checkpoint_reprs_are_one_short_line(tmp_path):
    """QA: a ScanPlan's repr (in a REPL) printed every tensor of the checkpoint. ScanPlan and Checkpoint now show
    one line: the source, the tensor count (counted here with safetensors' own loader), the target count and the
    settings, and no tensor name."""
    from oracles import load_all

    from plate_inspect.scanner import ScanSettings, plan_scan
    from plate_inspect.testing.synthetic import write_llama_like

    ckpt = write_llama_like(tmp_path / "ckpt", layers=4).path
    names = list(load_all(ckpt))
    plan = plan_scan(ckpt, ScanSettings(r=8))
    text = repr(plan)
    assert "\n" not in text and len(text) < 400, text
    assert not any(name in text for name in names), text
    assert text.startswith(f"ScanPlan(Checkpoint({str(ckpt)!r}, files=1, tensors={len(names)}, model_type='qwen2')")
    assert f"targets={7 * 4}, ScanSettings(r=8, " in text, text
