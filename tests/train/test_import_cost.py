"""What importing the trainer side costs, and that the compile-disabled settling step still keeps out of graphs.

``torch.compiler.disable`` as a decorator imports torch._dynamo (2-3 s) when the class is defined, so every
``import plate_inspect.train.layer`` (apply_bundle, the CLI commands that read adapters) paid it; the settling step
is now disabled lazily (``compile_disabled``). Oracle for the compiled runs: the same model in eager mode.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from helpers_train import BACKBONE, load_digits, randomize_adapters
from safetensors.torch import load_file

from plate_inspect.experiments import digits
from plate_inspect.train.layer import apply_bundle, compile_disabled, load_adapter, plate_layers, save_adapter


def test_importing_the_trainer_side_leaves_torch_dynamo_unloaded():
    code = (
        "import sys, plate_inspect, plate_inspect.train.layer, plate_inspect.train.variants, "
        "plate_inspect.train.sequential; plate_inspect.apply_bundle; "
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:300]


def test_compile_disabled_runs_the_method_and_keeps_its_name():
    calls = []

    @compile_disabled
    def settle(a: int, b: int = 2) -> int:
        """Doc."""
        calls.append((a, b))
        return a + b

    assert settle(1, b=5) == 6 and calls == [(1, 5)]
    assert settle.__name__ == "settle" and settle.__doc__ == "Doc."


def _plate_linear_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A base checkpoint's keys under apply_bundle's names (``fc1.weight`` -> ``fc1.base.weight``)."""
    return {
        (f"{k.split('.')[0]}.base.{k.split('.')[1]}" if k.split(".")[0] in BACKBONE else k): v for k, v in state.items()
    }


def test_a_compiled_apply_bundle_model_settles_at_its_first_call(digits_setup, tmp_path):
    """PlateLinear's settling step (weight check, B/Q reload: numpy, hashing) runs eagerly under torch.compile."""
    _, ckpt, bundle = digits_setup
    ref = load_digits(ckpt)
    randomize_adapters(apply_bundle(ref, bundle, rho=0.7), seed=8)
    save_adapter(ref, tmp_path / "a.safetensors")
    with torch.device("meta"):
        model = digits.DigitsMLP()
    apply_bundle(model, bundle, rho=0.7)
    model.to_empty(device="cpu")
    model.load_state_dict(_plate_linear_keys(load_file(str(ckpt))), strict=False)
    load_adapter(model, tmp_path / "a.safetensors")
    assert all(layer._awaiting for layer in plate_layers(model).values())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()  # a fresh compile cache: each layer is an entry of PlateLinear.forward's (limit 8)
    try:
        compiled = torch.compile(model, backend="aot_eager")
        torch.testing.assert_close(compiled(x), ref(x), rtol=0, atol=0)
        assert not any(layer._awaiting for layer in plate_layers(model).values())
        torch.testing.assert_close(compiled(x), ref(x), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()  # later tests compile PlateLinear.forward with fullgraph=True: left the room
