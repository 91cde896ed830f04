"""``plate-inspect health`` as a user meets it: a manifest's health that a scan did not write is one error
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


def test_experts_share_a_row_of_their_means_unless_listed(tmp_path):
    """QA: a MoE bundle's table had one row per expert (~46,000 for DeepSeek-V3); a layer's experts of one type now
    share a row with each metric's mean over them, checked against the manifest JSON; --experts lists them all."""
    from plate_inspect.testing.synthetic import write_family

    ckpt = write_family(tmp_path / "mixtral", "mixtral")
    out = tmp_path / "moe"
    plate_inspect.scan(ckpt.path, out, r=4, max_rank=16)
    modules = json.loads((out / "manifest.json").read_text())["modules"]
    members = [n for n in modules if n.startswith("model.layers.1.block_sparse_moe.experts.") and n.endswith(".w2")]
    assert len(members) > 1
    res = CliRunner().invoke(cli, ["health", str(out)], terminal_width=250)
    assert res.exit_code == 0, res.output
    rows = {line.split()[0]: line.split() for line in res.output.splitlines() if line.strip().startswith("model.")}
    row = rows["model.layers.1.block_sparse_moe.experts.*.w2"]
    assert row[1:4] == ["[" + str(len(members)), "experts,", "mean]"]
    for col, cell in zip(("alpha", "alpha_weighted", "spectral_norm", "stable_rank"), row[4:8], strict=True):
        values = [modules[n]["health"][col] for n in members if modules[n]["health"][col] is not None]
        assert float(cell) == pytest.approx(sum(values) / len(values), rel=1e-3)
    assert not any(".experts.1." in name for name in rows)
    dense = sum(1 for n in modules if ".experts." not in n)
    groups = {n.split(".experts.")[0] + n[n.rindex(".") :] for n in modules if ".experts." in n}
    assert len(rows) == dense + len(groups)
    listed = CliRunner().invoke(cli, ["health", str(out), "--experts"], terminal_width=250)
    assert {line.split()[0] for line in listed.output.splitlines() if line.strip().startswith("model.")} == set(modules)
