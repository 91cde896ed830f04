"""The streaming scanner end to end, against dense oracles computed from safetensors' own loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import dense_oracle, load_all

import plate_inspect
from plate_inspect import Bundle, verify
from plate_inspect.checkpoint import fingerprint_tensor

R, TAU, MAX_RANK = 8, 0.9, 48


def check_bundle_against_oracle(bundle: Bundle, tensors: dict[str, torch.Tensor], conv1d: bool = False, r=R):
    for rec in bundle:
        stored = tensors[rec.name + ".weight"]
        w = (stored.T if conv1d else stored).double().numpy()
        scores, b, evals, k, gram = dense_oracle(w, r, TAU, MAX_RANK)
        assert rec.shape == list(w.shape)
        assert rec.fingerprint == fingerprint_tensor(stored)
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
    report = verify(b, qwen_ckpt.path, orthonormality_tol=2e-2)
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
    with pytest.raises(plate_inspect.BundleError, match="--overwrite"):
        plate_inspect.scan(qwen_ckpt.path, out, r=R + 1)
    b = plate_inspect.scan(qwen_ckpt.path, out, r=R + 1, overwrite=True)
    assert b.settings.r == R + 1


_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import plate_inspect
    from plate_inspect.scanner import ScanProgress

    class Killer(ScanProgress):
        def __init__(self, after, how):
            self.n, self.after, self.how = 0, after, how
        def module_done(self, name, nbytes):
            self.n += 1
            if self.n == self.after:
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise KeyboardInterrupt

    src, out, after, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    plate_inspect.scan(src, out, r=8, progress=Killer(after, how))
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
    partial = json.loads((out / "manifest.json").read_text())
    assert partial["complete"] is False and len(partial["modules"]) == 7
    with pytest.raises(plate_inspect.BundleError, match="incomplete"):
        Bundle.load(out)
    resumed = plate_inspect.scan(qwen_ckpt.path, out, r=R)
    assert resumed.stats()["modules_resumed"] == 7
    for p in reference.path.iterdir():
        if p.name != "scan_stats.json":
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_verify_detects_other_weights(tmp_path, qwen_ckpt):
    bundle = plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=R)
    assert verify(bundle, qwen_ckpt.path).ok
    other = plate_inspect.testing.synthetic.write_llama_like(tmp_path / "other", layers=2, seed=1)
    report = verify(bundle, other.path)
    assert not report.ok and len(report.problems) == 14
    assert "fingerprint" in report.problems[0]


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
