"""A PLATE layer given an input of the wrong width names itself and both widths (torch's "mat1 and mat2 shapes
cannot be multiplied (2x5 and 4x3)" named neither); the check stays out of torch.compile's way."""

from __future__ import annotations

import pytest
import torch
from helpers_train import BACKBONE, digits_setup, load_digits
from peft import get_peft_model
from torch import nn

from plate_inspect.train.layer import PlateLinear, apply_bundle
from plate_inspect.train.peft import PlateConfig


def _layer(d_in: int = 8, d_out: int = 6, seed: int = 0) -> PlateLinear:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = PlateLinear(
        nn.Linear(d_in, d_out), torch.tensor([0, 2]), torch.linalg.qr(torch.randn(d_in, 3, generator=g))[0]
    )
    with torch.no_grad():
        layer.plate_A.normal_(generator=g)
    return layer


def test_a_layer_made_by_hand_names_its_class_and_both_widths():
    with pytest.raises(RuntimeError) as e:
        _layer()(torch.randn(2, 5))
    assert str(e.value) == (
        "PlateLinear: the input's last dimension is 5 (input shape [2, 5]), but this layer maps 8 input features to "
        "6; feed it tensors of shape [..., 8]"
    )


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    _, ckpt, bundle = digits_setup(tmp_path_factory.mktemp("layer_input"), r=8, tau=0.8)
    return ckpt, bundle


def test_apply_bundle_and_peft_layers_are_named(digits):
    """fc2 of the digits MLP takes fc1's 256 outputs; given 64 features it names itself, by the bundle's name
    (apply_bundle) or the model's (get_peft_model)."""
    ckpt, bundle = digits
    model = load_digits(ckpt)
    apply_bundle(model, bundle)
    d_in = model.fc2.d_in
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=rf"^fc2: the input's last dimension is 64 .* maps {d_in} input features"):
        model.fc2(x)
    peft_model = get_peft_model(load_digits(ckpt), PlateConfig(bundle=str(bundle.path)))
    with pytest.raises(RuntimeError, match=rf"^fc2: the input's last dimension is 64 .* maps {d_in} input features"):
        peft_model.base_model.model.fc2(x)
    for m in BACKBONE:  # the right width still runs, as before
        layer = getattr(model, m)
        assert layer(torch.zeros(1, layer.d_in)).shape == (1, layer.d_out)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_layer_matches_eager_over_batch_sizes(dynamic):
    """fullgraph=True: the check adds no graph break; dynamic shapes: it guards the width, batches still vary."""
    layer = _layer()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for batch in (2, 5, 7):
        x = torch.randn(batch, 3, 8)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError):  # torch.compile's own wrapper (our text inside it, in torch 2.13)
        compiled(torch.randn(2, 7))
