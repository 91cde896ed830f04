"""Fixtures of the distributed tests, one definition each."""

from __future__ import annotations

import pytest

from plate_inspect.testing.synthetic import write_llama_like


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A sharded bf16 Qwen2-layout checkpoint with 4 layers in 4 part files (rank 0 of two gets layers 0 and 2,
    rank 1 layers 1 and 3)."""
    return write_llama_like(tmp_path_factory.mktemp("four_layers") / "model", layers=4, max_shard_bytes=150_000, seed=3)
