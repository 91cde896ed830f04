"""QA of ``plate-inspect health`` as a user meets it: a manifest's health that a scan did not write is one error
line, and modules without a health record are counted, not silently dropped."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import plate_inspect
from plate_inspect.cli.main import cli


@pytest.fixture()
def bundle(qwen_ckpt, tmp_path):
    out = tmp_path / "b"
    plate_inspect.scan(qwen_ckpt.path, out, r=8, layers=[0])
    return out


def edit_manifest(bundle, edit) -> list[str]:
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    names = list(manifest["modules"])
    edit(manifest["modules"])
    path.write_text(json.dumps(manifest))
    return names


@pytest.mark.parametrize(("field", "value"), [("alpha", "x"), ("stable_rank", [1]), ("num_spikes", True)])
def test_a_health_field_that_is_not_a_number_is_one_line(bundle, field, value):
    """QA: ``"alpha": "x"`` ended in a ValueError traceback from the number format."""
    names = edit_manifest(bundle, lambda mods: next(iter(mods.values()))["health"].__setitem__(field, value))
    res = CliRunner().invoke(cli, ["health", str(bundle)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = res.output.strip().splitlines()
    assert line == (
        f"error: {bundle / 'manifest.json'}: module '{names[0]}': health field '{field}' is {value!r}, not a number "
        "(the manifest was edited or is corrupt); rescan the model into it with --overwrite to rewrite it"
    )


def test_modules_without_health_are_counted(bundle):
    def drop_every_other(mods):
        for i, rec in enumerate(mods.values()):
            if i % 2:
                rec.pop("health")

    names = edit_manifest(bundle, drop_every_other)
    res = CliRunner().invoke(cli, ["health", str(bundle)])
    assert res.exit_code == 0, res.output
    lacking = len(names) // 2
    assert f"{lacking} modules of {len(names)} without a health record (not shown" in res.output
    shown = [line.split()[0] for line in res.output.splitlines() if line.strip().startswith("model.layers")]
    assert shown == names[::2]
