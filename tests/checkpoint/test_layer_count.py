"""check_layer_count compares the text stack with num_hidden_layers only: a multimodal model's vision or audio tower
has its own count (vision_config), so targets chosen there alone are never refused by the text model's count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plate_inspect.errors import CorruptCheckpointError
from plate_inspect.targets import check_layer_count


def modules(stack: str, layers: range) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=f"{stack}.{i}.self_attn.q_proj") for i in layers]


CONFIG = {"text_config": {"num_hidden_layers": 4}, "vision_config": {"num_hidden_layers": 2}}
TEXT = "model.language_model.layers"
VISION = "model.vision_tower.vision_model.encoder.layers"


def test_the_vision_tower_alone_is_not_held_to_the_text_count():
    candidates = modules(TEXT, range(4)) + modules(VISION, range(2))
    check_layer_count(CONFIG, candidates, modules(VISION, range(2)))


def test_the_text_stack_is_still_checked():
    candidates = modules(TEXT, range(3)) + modules(VISION, range(2))
    with pytest.raises(CorruptCheckpointError, match="layers 0-3.*layer 3 missing"):
        check_layer_count(CONFIG, candidates, modules(TEXT, range(3)))


def test_a_complete_text_stack_passes():
    candidates = modules(TEXT, range(4)) + modules(VISION, range(2))
    check_layer_count(CONFIG, candidates, modules(TEXT, range(4)))
