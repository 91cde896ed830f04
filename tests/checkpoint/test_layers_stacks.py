"""Stack-qualified layer selection (``--layers decoder:0-1``): one stack of an encoder-decoder model (T5, BART).

Plain indices keep their meaning (layer i of every stack: encoder block i and decoder block i). Oracle: the
nn.Linear modules transformers builds inside each stack's layer i (named by transformers, not by plate-inspect).
"""

from __future__ import annotations

import json

import pytest
from helpers_checkpoint import STACKS, stack_modules
from helpers_cli import assert_user_error, run_cli

import plate_inspect
from plate_inspect.bundle import Bundle, ScanSettings
from plate_inspect.errors import ConfigError
from plate_inspect.targets import parse_layers


def test_parse_layers_reads_stack_qualifiers():
    assert parse_layers("0-2,7") == [0, 1, 2, 7]  # plain: as before
    assert parse_layers("decoder:0-2") == ["decoder:0", "decoder:1", "decoder:2"]
    assert parse_layers("encoder:0,decoder:5,1") == [1, "decoder:5", "encoder:0"]
    assert parse_layers(" decoder : 1 - 2 , decoder:1") == ["decoder:1", "decoder:2"]
    assert parse_layers("model.decoder.layers:3") == ["model.decoder.layers:3"]
    # a whole stack: its name alone, or 'stack:*' (read as the same); its own indices beside it are dropped
    assert parse_layers("decoder") == parse_layers("decoder:*") == ["decoder"]
    assert parse_layers("encoder,decoder:0-2") == ["decoder:0", "decoder:1", "decoder:2", "encoder"]
    assert parse_layers("decoder:1, decoder : * ,0") == [0, "decoder"]
    for bad in ("decoder:", ":3", "decoder:a", "decoder:3-1", "de coder:1", "decoder:1:2", "*", "decoder:*-2", "dec*"):
        with pytest.raises(ConfigError, match="--layers"):
            parse_layers(bad)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_one_stack_is_selected_and_plain_indices_select_both(models, family, tmp_path):
    path, layers = models[family]
    picked = plate_inspect.scan(path, tmp_path / "d", r=4, max_rank=16, layers=parse_layers("decoder:0-1"))
    assert sorted(picked.modules) == stack_modules(layers, ("decoder", 0), ("decoder", 1))
    mixed = plate_inspect.scan(path, tmp_path / "m", r=4, max_rank=16, layers=["encoder:1", "decoder:2"])
    assert sorted(mixed.modules) == stack_modules(layers, ("encoder", 1), ("decoder", 2))
    plain = plate_inspect.scan(path, tmp_path / "p", r=4, max_rank=16, layers=[0])  # today's meaning: both stacks
    assert sorted(plain.modules) == stack_modules(layers, ("encoder", 0), ("decoder", 0))
    # the full path of a stack names it too
    full = plate_inspect.scan(path, tmp_path / "f", r=4, max_rank=16, layers=[f"{STACKS[family]['encoder'][0]}:0"])
    assert sorted(full.modules) == stack_modules(layers, ("encoder", 0))


def test_cli_scan_and_audit_take_a_stack(models, tmp_path):
    path, layers = models["bart"]
    code, output = run_cli("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers",
                           "decoder:1", "-q")  # fmt: skip
    assert code == 0, output
    bundle = Bundle.load(tmp_path / "b")
    assert sorted(bundle.modules) == stack_modules(layers, ("decoder", 1))
    assert bundle.settings.layers == ("decoder:1",)
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["config"]["layers"] == ["decoder:1"]
    # audit without a bundle: the checkpoint's stacks
    code, output = run_cli("audit", path, path, "--r", "4", "--layers", "encoder:0,decoder:2", "--json")
    assert code == 0, output
    assert sorted(r["module"] for r in json.loads(output)) == stack_modules(layers, ("encoder", 0), ("decoder", 2))
    # audit with a bundle of the whole model: narrowed to one stack's layer
    whole = plate_inspect.scan(path, tmp_path / "all", r=4, max_rank=16)
    code, output = run_cli("audit", path, path, "--bundle", whole.path, "--layers", "decoder:0", "--json")
    assert code == 0, output
    assert sorted(r["module"] for r in json.loads(output)) == stack_modules(layers, ("decoder", 0))
    records = plate_inspect.audit(path, path, whole, layers=["encoder:1"])
    assert sorted(r.module for r in records) == stack_modules(layers, ("encoder", 1))


def test_rescan_with_an_equivalent_stack_spelling_goes_on(models, tmp_path):
    path, _ = models["t5"]
    first = plate_inspect.scan(path, tmp_path / "b", r=4, max_rank=16, layers=["decoder:0", "decoder:1"])
    again = plate_inspect.scan(path, tmp_path / "b", r=4, max_rank=16, layers=parse_layers("decoder.block:1,decoder:0"))
    assert again.stats()["modules_resumed"] == len(first.modules)
    assert again.settings == first.settings
    with pytest.raises(plate_inspect.BundleError, match="other settings"):
        plate_inspect.scan(path, tmp_path / "b", r=4, max_rank=16, layers=["decoder:0"])


def test_bad_stack_selections_are_one_line_errors(models, qwen_ckpt, tmp_path):
    t5, _ = models["t5"]
    out = tmp_path / "b"
    assert_user_error(["scan", t5, "--out", out, "--layers", "middle:0", "-q"],
                      "no layer stack 'middle'", "encoder (encoder.block, 2 layers: 0-1)",
                      "decoder (decoder.block, 3 layers: 0-2)")  # fmt: skip
    assert_user_error(["scan", t5, "--out", out, "--layers", "decoder:3", "-q"],
                      "the decoder stack (decoder.block) has 3 layers (0-2), no layer 3")  # fmt: skip
    assert_user_error(["scan", t5, "--out", out, "--layers", "encoder:0-2", "-q"],
                      "the encoder stack (encoder.block) has 2 layers (0-1), no layer 2")  # fmt: skip
    assert_user_error(["scan", t5, "--out", out, "--layers", "block:0", "-q"], "'block' names 2 layer stacks")
    assert_user_error(["scan", qwen_ckpt.path, "--out", out, "--layers", "decoder:0", "-q"],
                      "one layer stack (model.layers, 2 layers: 0-1)", "give plain layer indices")  # fmt: skip
    assert_user_error(["audit", qwen_ckpt.path, qwen_ckpt.path, "--layers", "encoder:1"], "one layer stack")
    assert_user_error(["scan", t5, "--out", out, "--layers", "decoder:x", "-q"], "cannot parse 'decoder:x'")
    assert not out.exists()
    # no stack has a plain index: nothing matched, the layers there named per stack
    assert_user_error(["scan", t5, "--out", out, "--layers", "7", "-q"], "layers [7]",
                      "its layers: encoder 0-1, decoder 0-2")  # fmt: skip
    for bad in (["decoder:0-1"], [-1], [1.5], [True], ["decoder:*:1"], ["*"]):
        with pytest.raises(ConfigError, match="not a layer index"):
            ScanSettings(layers=bad)
    assert ScanSettings(layers=[" decoder : 2", "3", 1, "encoder:*", " decoder"]).layers == (
        "decoder:2", 3, 1, "encoder", "decoder")  # fmt: skip


def test_audit_of_a_one_stack_bundle_names_the_models_stacks(models, tmp_path):
    """A bundle (or adapter) may hold one stack only: 'encoder:0' and 'decoder:2' still name the model's stacks and
    layers (then keep none of the bundle's modules), rather than being read against the bundle's single stack."""
    path, layers = models["t5"]
    decoder = plate_inspect.scan(path, tmp_path / "d", r=4, max_rank=16, layers=parse_layers("decoder:0-1"))
    records = plate_inspect.audit(path, path, decoder, layers=["decoder:1"])
    assert sorted(r.module for r in records) == stack_modules(layers, ("decoder", 1))
    for entry in ("encoder:0", "decoder:2"):
        with pytest.raises(ConfigError, match=rf"selection \(layers {entry}\) keeps none of the \d+ modules"):
            plate_inspect.audit(path, path, decoder, layers=[entry])
    with pytest.raises(ConfigError, match=r"the decoder stack \(decoder.block\) has 3 layers \(0-2\), no layer 3"):
        plate_inspect.audit(path, path, decoder, layers=["decoder:3"])


def test_a_misshapen_weight_in_a_selected_stack_layer_is_refused(models, tmp_path):
    """The not-2-D check covers stack-qualified selections too (it compared 'decoder:1' with layer ints: skipped)."""
    from safetensors.torch import load_file, save_file

    source, _ = models["bart"]
    broken = tmp_path / "bart"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    name = "model.decoder.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name].flatten().contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    for layers in (["decoder:1"], ["decoder"]):
        with pytest.raises(plate_inspect.CheckpointError, match=f"tensor '{name}' has shape \\[1024\\]"):
            plate_inspect.scan(broken, tmp_path / "out", r=4, layers=layers)
