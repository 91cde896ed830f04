"""Fixtures for every test: generated checkpoints with real HF layouts and the real embedded MiniLM (one per session),
an untrained digits MLP with its bundle (one per test module).

Shared helpers live in modules beside this file (oracles, helpers_train, ...), not here: a test module cannot
import from conftest once subdirectories have their own conftest.py (pytest imports each as ``conftest``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plate_inspect.testing.synthetic import write_bert, write_gpt2, write_llama_like


@pytest.fixture(scope="session")
def qwen_ckpt(tmp_path_factory):
    """Sharded bf16 Qwen2-layout checkpoint (index.json, GQA k/v, biases) with planted duplicate rows."""
    return write_llama_like(
        tmp_path_factory.mktemp("qwen2") / "model", layers=2, max_shard_bytes=150_000, planted_fraction=0.15
    )


@pytest.fixture(scope="session")
def gpt2_ckpt(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("gpt2") / "model")


@pytest.fixture(scope="session")
def bert_ckpt(tmp_path_factory):
    return write_bert(tmp_path_factory.mktemp("bert") / "model")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from plate_inspect.embedded import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def digits_setup(tmp_path_factory):
    """(root, checkpoint, bundle) of an untrained digits MLP (helpers_train.digits_setup), one per test module."""
    import helpers_train

    return helpers_train.digits_setup(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def digits_adapter(tmp_path_factory):
    """(checkpoint, bundle, save_adapter file) of an untrained digits MLP with r=8, tau=0.8, one per test module."""
    import helpers_train

    from plate_inspect.train.layer import apply_bundle, save_adapter

    root = tmp_path_factory.mktemp("digits-adapter")
    _, ckpt, bundle = helpers_train.digits_setup(root, r=8, tau=0.8)
    model = helpers_train.load_digits(ckpt)
    apply_bundle(model, bundle)
    return ckpt, bundle, save_adapter(model, root / "adapter.safetensors")
