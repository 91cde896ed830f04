"""PLATE on a quantized base layer (bitsandbytes ``Linear4bit`` / ``Linear8bitLt``, as QLoRA users load models).

Such a layer holds quantized codes (4-bit: uint8, packed to another shape; 8-bit: int8), while PLATE checks the
full-precision weight against the bundle and merges into it. Before, the 4-bit layer was refused as "another model"
(its packed shape), the 8-bit one as "other weights: rescan", and with ``check_fingerprints=False`` an 8-bit model
took merges into its int8 codes: a wrong merged model, silently (0.2 off in the logits). Now both routes refuse in
one line naming the module, the layer class and the dtype. The bitsandbytes tests use the real layers (bitsandbytes
is in the dev extra; its wheel runs on CPU); the stand-in test checks the same rule (a weight of integer codes).
"""

from __future__ import annotations

import pytest
import torch
from helpers_train import load_digits
from peft import get_peft_model
from torch import nn

from plate_inspect import scan
from plate_inspect.errors import BundleError
from plate_inspect.train.layer import apply_bundle
from plate_inspect.train.peft import PlateConfig

QUANTIZED = r"module '{}': its weight is quantized \({} holds torch\.{} codes.*without quantization_config"


class _Int8Codes(nn.Linear):
    """A stand-in for a quantized linear layer: the weight is int8 codes of nn.Linear's shape (as Linear8bitLt's)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.weight = nn.Parameter(torch.zeros(d_out, d_in, dtype=torch.int8), requires_grad=False)


@pytest.mark.parametrize("route", ["peft", "peft_unchecked", "apply_bundle"])
def test_a_layer_of_integer_codes_is_refused(digits_setup, route):
    _, ckpt, bundle = digits_setup
    model = load_digits(ckpt)
    model.fc2 = _Int8Codes(model.fc2.in_features, model.fc2.out_features)
    with pytest.raises(BundleError, match=QUANTIZED.format("fc2", "_Int8Codes", "int8")):
        if route == "apply_bundle":
            apply_bundle(model, bundle)
        else:
            get_peft_model(model, PlateConfig(bundle=str(bundle.path), check_fingerprints=route == "peft"))


@pytest.fixture(scope="module")
def qwen128(tmp_path_factory):
    """A tiny Qwen2 with hidden 128 (bitsandbytes' CPU 4-bit kernels want rows of at least one 64-block), scanned."""
    pytest.importorskip("bitsandbytes")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("qwen128")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(root / "model", safe_serialization=True)
    return root / "model", scan(root / "model", root / "bundle", r=4, tau=0.8, max_rank=16, overwrite=True)


@pytest.mark.parametrize(("bits", "cls", "dtype"), [(4, "Linear4bit", "uint8"), (8, "Linear8bitLt", "int8")])
def test_bitsandbytes_quantized_layers_are_refused(qwen128, bits, cls, dtype):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path, bundle = qwen128
    quant = BitsAndBytesConfig(load_in_4bit=True) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)

    def load():
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")

    what = QUANTIZED.format(r"model\.layers\.0\.[a-z_.]+", cls, dtype)
    with pytest.raises(BundleError, match=what):
        get_peft_model(load(), PlateConfig(bundle=str(bundle.path)))
    with pytest.raises(BundleError, match=what):  # was: merges written into the int8 codes (8-bit)
        get_peft_model(load(), PlateConfig(bundle=str(bundle.path), check_fingerprints=False))
    with pytest.raises(BundleError, match=what):
        apply_bundle(load(), bundle)
