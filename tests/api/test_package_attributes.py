"""What a notebook user meets after ``import plate_inspect as pi``: submodules as attributes, a clear error else."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_submodules_are_attributes_without_their_own_import():
    """README: ``plate_inspect.scan(plate_inspect.embedded.default_model_path(), out=...)`` after ``import
    plate_inspect`` (it was an AttributeError unless something had imported plate_inspect.embedded)."""
    code = (
        "import sys, pathlib, plate_inspect as pi\n"
        "assert 'torch' not in sys.modules\n"
        "path = pi.embedded.default_model_path()\n"
        "assert (pathlib.Path(path) / 'config.json').is_file(), path\n"
        "assert callable(pi.geometry.plate_geometry) and callable(pi.checkpoint.Checkpoint.open)\n"
        "assert pi.reports.write_report is sys.modules['plate_inspect.reports'].write_report\n"
        "print(pi.embedded.__name__, pi.testing.__name__)"
    )
    assert _run(code) == "plate_inspect.embedded plate_inspect.testing"


def test_exported_names_stay_functions_beside_the_submodules():
    """``pi.audit``/``pi.verify``/``pi.scan``/``pi.plan_budget`` are the functions, ``pi.auditing`` etc. the modules."""
    code = (
        "import inspect, plate_inspect as pi\n"
        "mods = [pi.auditing, pi.verification, pi.scanner, pi.plan]\n"
        "assert all(inspect.ismodule(m) for m in mods)\n"
        "print(all(inspect.isfunction(f) for f in [pi.audit, pi.verify, pi.scan, pi.plan_budget]))"
    )
    assert _run(code) == "True"


def test_unknown_attribute_is_still_an_attribute_error():
    import plate_inspect

    with pytest.raises(AttributeError, match="no attribute 'embeded'"):
        plate_inspect.embeded  # noqa: B018
    assert not hasattr(plate_inspect, "__wrapped__")


def test_dir_lists_the_api_and_the_submodules_tab_completion_offers():
    import plate_inspect

    shown = dir(plate_inspect)
    assert set(plate_inspect.__all__) <= set(shown) and {"embedded", "geometry", "reports", "checkpoint"} <= set(shown)
    for name in shown:  # every name offered resolves
        assert getattr(plate_inspect, name) is not None, name
