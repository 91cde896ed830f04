"""Bundle.mixed_up on a manifest alone (no files): the records grouped by part file once, not scanned per file.

Oracle: the part files' contents the test chose (which modules' tensors each holds), and the answer of a bundle
loaded afresh on the same manifest. The grouping is rebuilt when the manifest's module table is replaced.
"""

from __future__ import annotations

from pathlib import Path

from plate_inspect.bundle import TENSOR_KINDS, Bundle, Manifest, ModuleRecord, ScanSettings


def _record(name: str, layer: int, file: str) -> ModuleRecord:
    return ModuleRecord(name, "Linear", layer, [8, 8], "linear", "BF16", 4, 4, 1.0, 2.0, 0.5, {}, "sha256:0", file)


def _modules(layers: int, per_layer: int) -> dict[str, ModuleRecord]:
    records = [
        _record(f"model.layers.{layer}.m{i}", layer, f"layer-{layer:05d}.safetensors")
        for layer in range(layers)
        for i in range(per_layer)
    ]
    return {rec.name: rec for rec in records}


def _bundle(modules: dict[str, ModuleRecord]) -> Bundle:
    manifest = Manifest({"kind": "local", "id": "synthetic"}, ScanSettings(), modules, complete=True)
    return Bundle(Path("/nonexistent-bundle"), manifest)


def _keys(layer: int, per_layer: int, skip: int | None = None) -> list[str]:
    """The tensor names of a part holding ``layer``'s modules (all but module ``skip``)."""
    return [f"model.layers.{layer}.m{i}.{kind}" for i in range(per_layer) if i != skip for kind in TENSOR_KINDS]


def test_every_part_is_judged_by_its_own_modules():
    b = _bundle(_modules(layers=4, per_layer=3))
    files = [f"layer-{layer:05d}.safetensors" for layer in range(4)]
    assert [b.mixed_up(f, _keys(layer, 3)) for layer, f in enumerate(files)] == [""] * 4
    assert b.mixed_up(files[0], _keys(2, 3)) == (
        "holds layer 2's 3 modules (model.layers.2.m0, ...), not layer 0's 3 modules the manifest puts in it "
        "(part files renamed or swapped by hand; the manifest puts those in layer-00002.safetensors)"
    )
    assert b.mixed_up(files[3], _keys(3, 3, skip=1)) == (
        "lacks the tensors of layer 3's 1 module (model.layers.3.m1) that the manifest puts in it"
    )
    assert b.mixed_up("other.safetensors", []) == ""  # a file the manifest puts nothing in lacks nothing


def test_a_replaced_module_table_is_grouped_afresh():
    b = _bundle(_modules(layers=2, per_layer=2))
    assert b.mixed_up("layer-00000.safetensors", _keys(0, 2)) == ""  # grouped here
    moved = _modules(layers=2, per_layer=2)
    moved["model.layers.1.m0"] = _record("model.layers.1.m0", 1, "layer-00000.safetensors")  # now in layer 0's part
    b.manifest.modules = moved
    expected = _bundle(moved).mixed_up("layer-00000.safetensors", _keys(0, 2))
    assert expected.startswith("lacks the tensors of layer 1's 1 module (model.layers.1.m0)"), expected
    assert b.mixed_up("layer-00000.safetensors", _keys(0, 2)) == expected
