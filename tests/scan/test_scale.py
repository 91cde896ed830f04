"""Scale tests (slow, not in the default run): pytest -m slow.

A Qwen2.5-0.5B-shaped layer (hidden 896, intermediate 4864, GQA 14/2 heads, bf16, sharded) checked module by
module against the dense float64 oracle, including down_proj, whose 4864 x 4864 Gram the scanner never forms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import dense_oracle, load_all

import plate_inspect
from plate_inspect.testing.synthetic import write_llama_like

pytestmark = pytest.mark.slow


def test_qwen05b_shaped_layers_match_dense_oracle(tmp_path):
    ckpt = write_llama_like(
        tmp_path / "m",
        hidden=896,
        intermediate=4864,
        heads=14,
        kv_heads=2,
        layers=2,
        vocab=1000,
        max_shard_bytes=30_000_000,
        planted_fraction=0.05,
    )
    bundle = plate_inspect.scan(ckpt.path, tmp_path / "b", r=64, tau=0.9, max_rank=512)
    tensors = load_all(ckpt.path)
    for rec in bundle:
        w = tensors[rec.name + ".weight"].double().numpy()
        _, b, evals, k, gram = dense_oracle(w, 64, 0.9, 512)
        assert bundle.b_idx(rec.name).tolist() == b.tolist(), rec.name
        assert rec.k == k, rec.name
        q = bundle.q(rec.name, torch.float64).numpy()
        np.testing.assert_allclose(q.T @ q, np.eye(k), atol=5e-5)
        assert np.trace(q.T @ gram @ q) / evals.sum() == pytest.approx(evals[:k].sum() / evals.sum(), abs=1e-5)
