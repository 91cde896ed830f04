"""Whole layer stacks in ``--layers`` (``decoder``, ``encoder,decoder:0-2``), report rows of a one-stack bundle, and
the format version of bundles whose selection names stacks (session 16).

Oracles: the nn.Linear modules transformers builds under each stack of tiny T5 and BART models it saved itself
(named by transformers, not by plate-inspect), the rows a report of the whole model gives the same modules, and the
format check of plate-inspect versions before stack entries (``format_version`` must equal 1).
"""

from __future__ import annotations

import json

import pytest
from test_layers_stacks import STACKS, _one_line_error, _run, _want, models  # noqa: F401 (models: a fixture)

import plate_inspect
from plate_inspect.bundle import Bundle
from plate_inspect.errors import ConfigError
from plate_inspect.reports.data import report_data
from plate_inspect.targets import parse_layers


def _stack(layers: dict, stack: str) -> list[tuple[str, int]]:
    return sorted(key for key in layers if key[0] == stack)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_a_whole_stack_is_every_layer_of_it(models, family, tmp_path):  # noqa: F811
    path, layers = models[family]
    decoder = _want(layers, *_stack(layers, "decoder"))
    for i, spelling in enumerate(("decoder", "decoder:*", STACKS[family]["decoder"][0])):
        picked = plate_inspect.scan(path, tmp_path / f"d{i}", r=4, max_rank=16, layers=parse_layers(spelling))
        assert sorted(picked.modules) == decoder, spelling
    assert picked.settings.layers == (STACKS[family]["decoder"][0],)  # as given
    mixed = plate_inspect.scan(path, tmp_path / "m", r=4, max_rank=16, layers=parse_layers("encoder,decoder:0-1"))
    assert sorted(mixed.modules) == _want(layers, *_stack(layers, "encoder"), ("decoder", 0), ("decoder", 1))
    # a whole stack beside plain indices: the plain index still takes the other stack's layer too
    plain = plate_inspect.scan(path, tmp_path / "p", r=4, max_rank=16, layers=["encoder", 2])
    assert sorted(plain.modules) == _want(layers, *_stack(layers, "encoder"), ("decoder", 2))


def test_cli_scan_audit_and_api_take_a_whole_stack(models, tmp_path):  # noqa: F811
    path, layers = models["t5"]
    decoder = _want(layers, *_stack(layers, "decoder"))
    code, output = _run("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers", "decoder",
                        "-q")  # fmt: skip
    assert code == 0, output
    assert sorted(Bundle.load(tmp_path / "b").modules) == decoder
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["config"]["layers"] == ["decoder"]
    # the same spelling resumes; an equivalent one plans the same modules and goes on with the bundle's spelling
    for spelling in ("decoder", "decoder:*", "decoder:0-2", "decoder.block"):
        code, output = _run("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers",
                            spelling, "-q")  # fmt: skip
        assert code == 0, (spelling, output)
        again = Bundle.load(tmp_path / "b")
        assert again.settings.layers == ("decoder",) and again.stats()["modules_resumed"] == len(decoder), spelling
    code, output = _run("scan", path, "--out", tmp_path / "b", "--r", "4", "--max-rank", "16", "--layers",
                        "decoder:0-1", "-q")  # fmt: skip
    assert code != 0 and "other settings" in output, output
    # audit, without and with a bundle, CLI and API
    code, output = _run("audit", path, path, "--r", "4", "--layers", "encoder", "--json")
    assert code == 0, output
    assert sorted(r["module"] for r in json.loads(output)) == _want(layers, *_stack(layers, "encoder"))
    whole = plate_inspect.scan(path, tmp_path / "all", r=4, max_rank=16)
    code, output = _run("audit", path, path, "--bundle", whole.path, "--layers", "decoder,encoder:1", "--json")
    assert code == 0, output
    assert sorted(r["module"] for r in json.loads(output)) == sorted(decoder + _want(layers, ("encoder", 1)))
    records = plate_inspect.audit(path, path, whole, layers=["decoder:*"])
    assert sorted(r.module for r in records) == decoder
    # a decoder bundle audited for the encoder: the model has it, the bundle keeps none of it
    with pytest.raises(ConfigError, match=r"selection \(layers encoder\) keeps none of the \d+ modules"):
        plate_inspect.audit(path, path, again, layers=["encoder"])


def test_an_unknown_whole_stack_is_a_one_line_error(models, qwen_ckpt, tmp_path):  # noqa: F811
    t5, _ = models["t5"]
    out = tmp_path / "b"
    _one_line_error(["scan", t5, "--out", out, "--layers", "middle", "-q"], "--layers middle: no layer stack 'middle'",
                    "encoder (encoder.block, 2 layers: 0-1)")  # fmt: skip
    _one_line_error(["scan", t5, "--out", out, "--layers", "block:*", "-q"], "'block' names 2 layer stacks")
    _one_line_error(["scan", qwen_ckpt.path, "--out", out, "--layers", "decoder", "-q"],
                    "one layer stack (model.layers, 2 layers: 0-1), not 'decoder'",
                    "give plain layer indices")  # fmt: skip
    _one_line_error(["audit", t5, t5, "--layers", "0,middle"], "no layer stack 'middle'")
    _one_line_error(["scan", t5, "--out", out, "--layers", "decoder:*-1", "-q"], "cannot parse 'decoder:*-1'")
    assert not out.exists()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_report_rows_of_a_one_stack_bundle_name_the_stack(models, family, tmp_path):  # noqa: F811
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


def test_stack_selections_are_format_version_2_that_older_readers_refuse(models, tmp_path):  # noqa: F811
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
    assert sorted(Bundle.load(tmp_path / "s").modules) == _want(layers, *_stack(layers, "decoder"))
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(plate_inspect.BundleError, match=r"format version 3 is not supported .*\(reads versions 1, 2\)"):
        Bundle.load(tmp_path / "s")


def test_audit_report_rows_of_one_stack_name_the_stack(models, tmp_path):  # noqa: F811
    """The audit page's heatmap, for an audit narrowed to one stack (``--layers decoder:1``), labels its rows as an
    audit of the whole model does ('decoder 1', not '1')."""
    from plate_inspect.reports.audit import audit_figures

    path, _ = models["t5"]
    full = audit_figures(plate_inspect.audit(path, path, r=4))["heatmap"]["data"][0]["y"]
    assert "decoder 1" in full and "encoder 1" in full
    assert [r for r in full if r.startswith("decoder ")] == ["decoder 0", "decoder 1", "decoder 2"]
    for spelling, want in (("decoder:1", ["decoder 1"]), ("decoder", ["decoder 0", "decoder 1", "decoder 2"])):
        page = tmp_path / f"{spelling.replace(':', '_')}.html"
        code, output = _run("audit", path, path, "--r", "4", "--layers", spelling, "--report", page, "-q")
        assert code == 0, output
        heat = json.loads(page.read_text().split("const figs=")[1].split(";for (const")[0])["heatmap"]
        assert heat["data"][0]["y"] == want, spelling
