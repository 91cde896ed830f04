"""The layer stacks of the tiny encoder-decoder models (T5, BART) that checkpoint/conftest.py builds with
transformers, for the stack-selection tests (checkpoint/test_layers_stacks, checkpoint/test_whole_stacks)."""

from __future__ import annotations

#: Each family's stacks as transformers names them: (the stack's module path, its number of layers).
STACKS = {
    "t5": {"encoder": ("encoder.block", 2), "decoder": ("decoder.block", 3)},
    "bart": {"encoder": ("model.encoder.layers", 2), "decoder": ("model.decoder.layers", 3)},
}


def stack_modules(layers: dict, *keys: tuple[str, int]) -> list[str]:
    """The sorted names of the nn.Linear modules transformers built in the given (stack, layer index) keys."""
    return sorted(n for key in keys for n in layers[key])
