"""Fixtures of the plan tests used by more than one file."""

from __future__ import annotations

import pytest
import torch

from plate_inspect import scan
from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture(scope="module")
def three_r_bundle(tmp_path_factory):
    """r = 64 on a 64-wide model: q/o/down get r = 57, k/v (32 rows) 28, gate/up 64: three different r."""
    root = tmp_path_factory.mktemp("three_r")
    ckpt = write_llama_like(root / "model", layers=2, dtype=torch.float32, planted_fraction=0.1)
    return scan(ckpt.path, root / "bundle", r=64, tau=0.5, max_rank=512)
