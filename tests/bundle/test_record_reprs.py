"""What a notebook shows of the records read from a bundle or returned by verify: one line (a bounded few for a
VerifyReport), however many modules; the dataclass reprs printed every field, dict and tensor."""

from __future__ import annotations

import dataclasses

from helpers_reports import MOE_DENSE, MOE_EXPERTS, write_fake_bundle

from plate_inspect.bundle import Bundle
from plate_inspect.verification import ExactnessCheck, VerifyReport, verify


def test_module_record_repr_is_one_line_naming_the_module(tmp_path):
    bundle = Bundle.load(write_fake_bundle(tmp_path / "b", 1, MOE_DENSE))
    name = "model.layers.0.self_attn.q_a_proj"
    rec = dataclasses.replace(bundle.record(name), health={f"stat_{i}": float(i) for i in range(40)})
    text = repr(rec)
    assert "\n" not in text and len(text) < 250, text  # before: 1.2 kB (every health and k_by_tau entry)
    assert text.startswith(f"ModuleRecord({name!r}, self_attn.q_a_proj, layer=0, shape=[48, 64] linear BF16, ")
    assert f"r={rec.r}, k={rec.k}," in text and "file='layer-00000.safetensors'" in text and "health" in text


def test_module_plate_repr_names_its_tensors_without_printing_them(tmp_path):
    bundle = Bundle.load(write_fake_bundle(tmp_path / "b", 1, MOE_DENSE))
    name = "model.layers.0.mlp.shared_experts.up_proj"
    plate = bundle.plate(name)
    k = bundle.record(name).k
    assert repr(plate) == f"ModulePlate({name!r}, b_idx=8 rows, q=float32 [64, {k}])"


def test_verify_report_repr_stays_bounded_for_15k_modules():
    names = [f"model.layers.{i // 776}.mlp.experts.{i % 776}.up_proj" for i in range(15_520)]
    report = VerifyReport(
        "/bundles/big",
        "/models/big",
        modules_checked=len(names),
        problems=[f"module '{n}': weight fingerprint differs: the bundle was made for other weights" for n in names],
        changed=names,
        exactness={n: ExactnessCheck(1.0, 1.0, 0.1, 0.0) for n in names[:100]},
    )
    text = repr(report)
    lines = text.split("\n")
    assert len(text) < 1000 and len(lines) == 5, text  # before: 2.5 MB
    assert lines[0] == (
        "VerifyReport('/bundles/big', source='/models/big', ok=False, modules_checked=15520, problems=15520, "
        "notes=0, changed=15520, absent=0, exactness=100)"
    )
    assert lines[1] == f"  problem: {report.problems[0]}" and lines[4] == "  ... 15517 more in .problems"


def test_verify_report_repr_cuts_a_long_problem(tmp_path):
    report = VerifyReport("/b", None, modules_checked=1, problems=["x" * 500])
    assert repr(report).split("\n")[1] == "  problem: " + "x" * 199 + "…"


def test_a_clean_verify_report_is_one_line(tmp_path):
    report = verify(write_fake_bundle(tmp_path / "b", 1, MOE_DENSE, experts=MOE_EXPERTS, n_experts=2))
    assert report.ok and repr(report) == (
        f"VerifyReport({str(tmp_path / 'b')!r}, source=None, ok=True, modules_checked=6, problems=0, notes=0, "
        "changed=0, absent=0, exactness=0)"
    )
