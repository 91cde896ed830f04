"""Whole layer stacks in ``--layers`` (``decoder``, ``encoder,decoder:0-2``), report rows of a one-stack bundle, and
the format version of bundles whose selection names stacks; ``layers=`` as a string in the Python API, and how
info, layers_there and audit errors name a one-stack selection.

Oracles: the nn.Linear modules transformers builds under each stack of tiny T5 and BART models it saved itself
(named by transformers, not by plate-inspect), the rows a report of the whole model gives the same modules, and the
format check of plate-inspect versions before stack entries (``format_version`` must equal 1).
"""

from __future__ import annotations

import json

import pytest
from helpers_checkpoint import STACKS, stack_modules
from helpers_cli import assert_user_error, run_cli

import plate_inspect
from plate_inspect.bundle import Bundle, ScanSettings
from plate_inspect.errors import ConfigError
from plate_inspect.reports.data import report_data
from plate_inspect.targets import parse_layers


def _stack(layers: dict, stack: str) -> list[tuple[str, int]]:
    return sorted(key for key in layers if key[0] == stack)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_a_whole_stack_is_every_layer_of_it(models, family, tmp_path):
    path, layers = models[family]
    decoder = stack_modules(layers, *_stack(layers, "decoder"))
    for i, spelling in enumerate(("decoder", "decoder:*", STACKS[family]["decoder"][0])):
        picked = plate_inspect.scan(path, tmp_path / f"d{i}", r=4, max_rank=16, layers=parse_layers(spelling))
        assert sorted(picked.modules) == decoder, spelling
    assert picked.settings.layers == (STACKS[family]["decoder"][0],)  # as given
    mixed = plate_inspect.scan(path, tmp_path / "m", r=4, max_rank=16, layers=parse_layers("encoder,decoder:0-1"))
    assert sorted(mixed.modules) == stack_modules(layers, *_stack(layers, "encoder"), ("decoder", 0), ("decoder", 1))
    # a whole stack beside plain indices: the plain index still takes the other stack's layer too
    plain = plate_inspect.scan(path, tmp_path / "p", r=4, max_rank=16, layers=["encoder", 2])
    assert sorted(plain.modules) == stack_modules(layers, *_stack(layers, "encoder"), ("decoder", 2))


def test_cli_scan_audit_and_api_take_a_whole_stack(models, tmp_path):
    path, layers = models["t5"]
    decoder = stack_modules(layers, *_stack(layers, "decoder"))
    code, output = run_cli("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers", "decoder",
                           "-q")  # fmt: skip
    assert code == 0, output
    assert sorted(Bundle.load(tmp_path / "b").modules) == decoder
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["config"]["layers"] == ["decoder"]
    # the same spelling resumes; an equivalent one plans the same modules and goes on with the bundle's spelling
    for spelling in ("decoder", "decoder:*", "decoder:0-2", "decoder.block"):
        code, output = run_cli("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers",
                               spelling, "-q")  # fmt: skip
        assert code == 0, (spelling, output)
        again = Bundle.load(tmp_path / "b")
        assert again.settings.layers == ("decoder",) and again.stats()["modules_resumed"] == len(decoder), spelling
    code, output = run_cli("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers",
                           "decoder:0-1", "-q")  # fmt: skip
    assert code != 0 and "other settings" in output, output
    # audit, without and with a bundle, CLI and API
    code, output = run_cli("audit", path, path, "--r", "4", "--layers", "encoder", "--json")
    assert code == 0, output
    assert sorted(r["module"] for r in json.loads(output)) == stack_modules(layers, *_stack(layers, "encoder"))
    whole = plate_inspect.scan(path, tmp_path / "all", r=4, max_rank=16)
    code, output = run_cli("audit", path, path, "--bundle", whole.path, "--layers", "decoder,encoder:1", "--json")
    assert code == 0, output
    assert sorted(r["module"] for r in json.loads(output)) == sorted(decoder + stack_modules(layers, ("encoder", 1)))
    records = plate_inspect.audit(path, path, whole, layers=["decoder:*"])
    assert sorted(r.module for r in records) == decoder
    # a decoder bundle audited for the encoder: the model has it, the bundle keeps none of it
    with pytest.raises(ConfigError, match=r"selection \(layers encoder\) keeps none of the \d+ modules"):
        plate_inspect.audit(path, path, again, layers=["encoder"])


def test_an_unknown_whole_stack_is_a_one_line_error(models, qwen_ckpt, tmp_path):
    t5, _ = models["t5"]
    out = tmp_path / "b"
    assert_user_error(["scan", t5, "--out", out, "--layers", "middle", "-q"],
                      "--layers middle: no layer stack 'middle'", "encoder (encoder.block, 2 layers: 0-1)")  # fmt: skip
    assert_user_error(["scan", t5, "--out", out, "--layers", "block:*", "-q"], "'block' names 2 layer stacks")
    assert_user_error(["scan", qwen_ckpt.path, "--out", out, "--layers", "decoder", "-q"],
                      "one layer stack (model.layers, 2 layers: 0-1), not 'decoder'",
                      "give plain layer indices")  # fmt: skip
    assert_user_error(["audit", t5, t5, "--layers", "0,middle"], "no layer stack 'middle'")
    assert_user_error(["scan", t5, "--out", out, "--layers", "decoder:*-1", "-q"], "cannot parse 'decoder:*-1'")
    assert not out.exists()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_report_rows_of_a_one_stack_bundle_name_the_stack(models, family, tmp_path):
    """A report of one stack's layers labels each module's row as a report of the whole model does ('decoder 1',
    not '1', which would not tell the encoder's layer 1 from the decoder's)."""
    path, layers = models[family]
    whole = report_data([plate_inspect.scan(path, tmp_path / "all", r=4, max_rank=16)]).heatmaps[0]["k"]
    row_in_whole = {n: whole.rows[i] for i, row in enumerate(whole.names) for n in row if n is not None}
    assert "decoder 1" in whole.rows and "encoder 1" in whole.rows
    for i, spelling in enumerate(("decoder:1", "decoder", "encoder:0,encoder:1")):
        bundle = plate_inspect.scan(path, tmp_path / f"s{i}", r=4, max_rank=16, layers=parse_layers(spelling))
        hm = report_data([bundle]).heatmaps[0]["k"]
        shown = {n: hm.rows[r] for r, row in enumerate(hm.names) for n in row if n is not None}
        assert sorted(shown) == sorted(bundle.modules)
        assert shown == {n: row_in_whole[n] for n in shown}, spelling
    assert hm.rows == ["encoder 0", "encoder 1"]
    # plain indices: rows as before (per stack only where the bundle holds several)
    plain = report_data([plate_inspect.scan(path, tmp_path / "p", r=4, max_rank=16, layers=[1])]).heatmaps[0]["k"]
    assert plain.rows == ["encoder 1", "decoder 1"]


def test_stack_selections_are_format_version_2_that_older_readers_refuse(models, tmp_path):
    """Versions before stack entries read ``layers`` as ints (a ValueError traceback on 'decoder:1') but first refuse
    any format_version other than 1: a bundle with stack entries says version 2; every other bundle stays 1."""
    path, layers = models["bart"]
    stacked = plate_inspect.scan(path, tmp_path / "s", r=4, max_rank=16, layers=["decoder"])
    plain = plate_inspect.scan(path, tmp_path / "p", r=4, max_rank=16, layers=[0, 1, 2])
    whole = plate_inspect.scan(path, tmp_path / "w", r=4, max_rank=16)
    versions = {b: json.loads((tmp_path / b / "manifest.json").read_text())["format_version"] for b in "spw"}
    assert versions == {"s": 2, "p": 1, "w": 1}
    old_reader_refuses = {b: v != 1 for b, v in versions.items()}  # the check every earlier version made first
    assert old_reader_refuses == {"s": True, "p": False, "w": False}
    for b in (stacked, plain, whole):  # read back; the stored identity is what its content gives
        again = Bundle.load(b.path)
        assert again.manifest.identity == b.manifest.identity == again.manifest.content_identity()
    # a bundle of session 15 (stack entries, format_version 1) is still read
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    assert sorted(Bundle.load(tmp_path / "s").modules) == stack_modules(layers, *_stack(layers, "decoder"))
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(plate_inspect.BundleError, match=r"format version 3 is not supported .*\(reads versions 1, 2\)"):
        Bundle.load(tmp_path / "s")


def test_audit_report_rows_of_one_stack_name_the_stack(models, tmp_path):
    """The audit page's heatmap, for an audit narrowed to one stack (``--layers decoder:1``), labels its rows as an
    audit of the whole model does ('decoder 1', not '1')."""
    from plate_inspect.reports.audit import audit_figures

    path, _ = models["t5"]
    full = audit_figures(plate_inspect.audit(path, path, r=4))["heatmap"]["data"][0]["y"]
    assert "decoder 1" in full and "encoder 1" in full
    assert [r for r in full if r.startswith("decoder ")] == ["decoder 0", "decoder 1", "decoder 2"]
    for spelling, want in (("decoder:1", ["decoder 1"]), ("decoder", ["decoder 0", "decoder 1", "decoder 2"])):
        page = tmp_path / f"{spelling.replace(':', '_')}.html"
        code, output = run_cli("audit", path, path, "--r", "4", "--layers", spelling, "--report", page, "-q")
        assert code == 0, output
        heat = json.loads(page.read_text().split("const figs=")[1].split(";for (const")[0])["heatmap"]
        assert heat["data"][0]["y"] == want, spelling


def _layer_of(name: str) -> int:
    """The layer index in a Qwen2 module name (``model.layers.<i>.…``), read from the name itself."""
    return int(name.split(".")[2])


def test_a_layers_string_is_refused_not_read_as_its_characters(qwen_ckpt, models, tmp_path):
    """``layers="10"`` used to be iterated character by character: layers 1 and 0, i.e. the whole model, without a
    word; ``layers="decoder"`` gave "no layer stack 'd'". A string must be a spec expanded by parse_layers."""
    for spec in ("10", "1"):
        with pytest.raises(ConfigError, match=rf"layers='{spec}': a string.*parse_layers\('{spec}'\)"):
            plate_inspect.scan(qwen_ckpt.path, tmp_path / "b", r=4, max_rank=16, layers=spec)
        with pytest.raises(ConfigError, match=r"a string, not a list of entries"):
            ScanSettings(layers=spec)
    assert not (tmp_path / "b").exists()
    bart, layers = models["bart"]
    with pytest.raises(ConfigError, match=r"layers='decoder': a string"):
        plate_inspect.audit(bart, bart, r=4, layers="decoder")
    # the spec expanded: what a user meant
    one = plate_inspect.scan(qwen_ckpt.path, tmp_path / "one", r=4, max_rank=16, layers=parse_layers("1"))
    assert one.modules and {_layer_of(n) for n in one.modules} == {1}
    records = plate_inspect.audit(bart, bart, r=4, layers=parse_layers("decoder"))
    decoder = stack_modules(layers, *sorted(k for k in layers if k[0] == "decoder"))
    assert sorted(r.module for r in records) == decoder


def test_info_names_the_layer_selection(models, qwen_ckpt, tmp_path):
    """``info`` of a bundle of one stack used to read like one of the whole model ('targets: defaults for ...')."""
    bart, layers = models["bart"]
    for spelling, shown in (("decoder", "decoder"), ("encoder,decoder:0-1", "decoder:0,decoder:1,encoder")):
        out = tmp_path / spelling.replace(",", "_").replace(":", "")
        code, output = run_cli("scan", bart, "--out", out, "--r", "4", "--max-rank", "16", "--layers", spelling, "-q")
        assert code == 0, output
        code, output = run_cli("info", out)
        assert code == 0, output
        line = next(x for x in output.splitlines() if x.startswith("targets:"))
        assert line == f"targets: defaults for model_type 'bart'; layers {shown}", output
    code, output = run_cli("scan", qwen_ckpt.path, "--out", tmp_path / "q", "--r", "4", "--max-rank", "16", "-q")
    assert code == 0, output
    line = next(x for x in run_cli("info", tmp_path / "q")[1].splitlines() if x.startswith("targets:"))
    assert "layers" not in line  # no selection: nothing added


def test_layers_there_names_the_stack_of_a_one_stack_selection(models):
    """A decoder-only bundle's layers, in an error about a selection keeping none of them, read 'decoder 0-2' where
    the model has two stacks (they read '0-2': layers 0-2 of both stacks, which the bundle does not hold)."""
    from plate_inspect.targets import layers_there

    for family in ("t5", "bart"):
        _, layers = models[family]
        decoder = stack_modules(layers, *sorted(k for k in layers if k[0] == "decoder"))
        every = stack_modules(layers, *layers)
        assert layers_there(decoder, every) == "decoder 0-2", family
        assert layers_there(decoder) == "0-2"  # without the model: nothing tells one stack from the other
        assert layers_there(every, every) == layers_there(every) == "encoder 0-1, decoder 0-2"
        assert layers_there(stack_modules(layers, ("encoder", 1)), every) == "encoder 1"


def test_a_one_layer_stack_is_described_in_the_singular(tmp_path):
    """Gemma-3's vision tower has one layer here (its tensor names hold only index 0): '1 layer: 0', not '1 layers'."""
    from safetensors import safe_open

    from plate_inspect.testing.synthetic import write_family

    path = write_family(tmp_path / "gemma3", "gemma3").path
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        vision = {k.split(".")[4] for k in f.keys() if k.startswith("vision_tower.vision_model.encoder.layers.")}  # noqa: SIM118
    assert vision == {"0"}
    code, output = run_cli("scan", path, "--out", tmp_path / "b", "--layers", "middle", "-q")
    assert code == 2 and "(vision_tower.vision_model.encoder.layers, 1 layer: 0)" in output, output
    assert "2 layers: 0-1" in output, output
    code, output = run_cli("scan", path, "--out", tmp_path / "b", "--layers", "vision_tower:3", "-q")
    assert code == 2 and "(vision_tower.vision_model.encoder.layers) has 1 layer (0), no layer 3" in output, output


def test_audit_error_names_the_stack_a_one_stack_bundle_holds(models, tmp_path):
    """(needs /work/notes/qa16-auditing.py.patch) ``audit --bundle <decoder bundle> --layers encoder``: the error
    names the bundle's layers as 'decoder 0-2' (it said '0-2')."""
    bart, _ = models["bart"]
    code, output = run_cli("scan", bart, "--out", tmp_path / "d", "--r", "4", "--max-rank", "16", "--layers", "decoder",
                           "-q")  # fmt: skip
    assert code == 0, output
    code, output = run_cli("audit", bart, bart, "--bundle", tmp_path / "d", "--layers", "encoder")
    assert code == 2 and output.rstrip().endswith("its layers: decoder 0-2"), output
