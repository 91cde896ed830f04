"""Fixtures of the training tests used by more than one file."""

from __future__ import annotations

import pytest
from helpers_train import save_tiny_qwen2

from plate_inspect import scan


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A randomly initialised tiny Qwen2ForCausalLM saved with save_pretrained (safetensors) and scanned."""
    root = tmp_path_factory.mktemp("tiny_qwen")
    save_tiny_qwen2(root / "model")
    bundle = scan(root / "model", root / "bundle", r=4, tau=0.8, max_rank=16, overwrite=True)
    return root, bundle
