"""Fixtures of the CLI tests, one definition each: mount points to clean up, a model with its bundle and adapter,
a tiny BERT without tokenizer files."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers_train import randomize_adapters, skeleton

from plate_inspect import scan
from plate_inspect.testing.synthetic import write_llama_like
from plate_inspect.train.layer import apply_bundle, save_adapter


@pytest.fixture
def mounts():
    """Mount points made by a test, unmounted afterwards (lazily, so a failing test cannot leave one behind)."""
    made: list[Path] = []
    yield made
    for path in reversed(made):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("bert") / "bert"
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.BertModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, model dir, its bundle, an adapter trained on it): one file, 2 layers, 14 modules."""
    root = tmp_path_factory.mktemp("qa")
    model = write_llama_like(root / "qwen", layers=2).path
    bundle = scan(model, root / "bundle", r=4, tau=0.9, max_rank=64)
    net = skeleton(model, bundle.modules)
    randomize_adapters(apply_bundle(net, bundle), seed=0, scale=0.05)
    return root, model, bundle, save_adapter(net, root / "adapter.safetensors")
