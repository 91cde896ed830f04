"""Fixtures of the checkpoint tests, one definition each: tiny T5 and BART models transformers saved (layer stacks),
the stand-in hub on 127.0.0.1."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from helpers_checkpoint import STACKS
from helpers_hub import StandInHub


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(path, {(stack, i): the names of the nn.Linear modules transformers built in that stack's layer i})."""
    out = {}
    for family, stacks in STACKS.items():
        path = tmp_path_factory.mktemp(family) / "model"
        model = _build(family, path)
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        layers = {
            (stack, i): sorted(n for n in linears if n.startswith(f"{prefix}.{i}."))
            for stack, (prefix, count) in stacks.items()
            for i in range(count)
        }
        assert all(layers.values())
        out[family] = (path, layers)
    return out


def _build(family: str, path):
    import transformers as t

    torch.manual_seed(0)
    if family == "t5":
        config = t.T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                            vocab_size=64)  # fmt: skip
        model = t.T5ForConditionalGeneration(config)
    else:
        config = t.BartConfig(d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=64,
                              max_position_embeddings=64)  # fmt: skip
        model = t.BartForConditionalGeneration(config)
    model.save_pretrained(path)
    return model


@pytest.fixture
def hub():
    """The stand-in hub on 127.0.0.1 (a free port), with its request log; stopped after the test."""
    StandInHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
