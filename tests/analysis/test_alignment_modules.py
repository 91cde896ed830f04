"""The alignment analysis split by job: each module imports on its own (no cycle), the math alone pulls in no model
code, transformers is imported only when a Hugging Face model is loaded, and the public path re-exports every piece."""

from __future__ import annotations

import pytest
from helpers_imports import modules_after_import

LEAVES = ("alignment_math", "activations", "hf_text")


@pytest.mark.parametrize("leaf", [*LEAVES, "alignment"])
def test_each_module_imports_first_and_never_imports_transformers(leaf):
    loaded = modules_after_import(f"plate_inspect.analysis.{leaf}")
    assert f"plate_inspect.analysis.{leaf}" in loaded
    assert "transformers" not in loaded


def test_the_math_alone_imports_no_model_code():
    """Records and VE/AL from (W, Sigma) need torch and the geometry, not the layers, targets or checkpoint reader."""
    loaded = modules_after_import("plate_inspect.analysis.alignment_math")
    heavy = {"plate_inspect.train.layer", "plate_inspect.targets", "plate_inspect.checkpoint", "transformers"}
    assert not heavy & loaded, sorted(heavy & loaded)


def test_the_public_path_re_exports_each_piece_itself():
    import importlib

    from plate_inspect.analysis import alignment

    homes = {leaf: importlib.import_module(f"plate_inspect.analysis.{leaf}") for leaf in LEAVES}
    found = {}
    for name in alignment.__all__:
        owners = [leaf for leaf, mod in homes.items() if getattr(mod, name, None) is getattr(alignment, name)]
        found[name] = owners
    assert all(found[n] for n in alignment.__all__ if n != "AlignmentError"), found
    # every public name of the leaves is reachable from the public path
    for leaf, mod in homes.items():
        defined = [
            n for n, v in vars(mod).items() if not n.startswith("_") and getattr(v, "__module__", None) == mod.__name__
        ]
        assert set(defined) <= set(alignment.__all__), (leaf, sorted(set(defined) - set(alignment.__all__)))
