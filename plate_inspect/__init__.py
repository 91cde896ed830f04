"""plate-inspect: offline PLATE geometry for safetensors checkpoints, shipped as PLATE init bundles.

Main entry points::

    import plate_inspect
    bundle = plate_inspect.scan("Qwen/Qwen2.5-7B", out="bundles/qwen7b", tau=0.9)
    bundle = plate_inspect.Bundle.load("bundles/qwen7b")
    b_idx, q = bundle.b_idx(name), bundle.q(name)
    trainable = plate_inspect.apply_bundle(model, bundle, rho=0.5)   # PLATE layers, weights checked

The public API (``__all__``), by job:

- make a bundle: :func:`scan` (its settings: :class:`ScanSettings`)
- read one: :class:`Bundle` (``Bundle.load``; a :class:`ModuleRecord` per module)
- check one against a checkpoint's weights: :func:`verify`
- train with one: :func:`apply_bundle` (:func:`finish_meta_init` after a meta-device load); choose k per module
  for a parameter budget: :func:`plan_budget`
- measure a fine-tune or adapter against the geometry: :func:`audit`
- errors: :class:`PlateInspectError`, and its :class:`ConfigError` (a bad setting or argument),
  :class:`CheckpointError`, :class:`BundleError` (the full tree: ``plate_inspect.errors``)

Each name is imported on first use, so ``import plate_inspect`` does not load torch. The building blocks live in
the modules: ``checkpoint`` (lazy safetensors reading), ``geometry`` (the math, pure functions), ``scanner``,
``bundle``, ``targets``, ``auditing``, ``verification``, ``health``, ``train``, ``analysis``, ``embedded`` (the
bundled all-MiniLM-L6-v2), ``reports``; each is an attribute too, imported on first use (``pi.geometry``).
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

# The public API, imported on first use (PEP 562) so that `import plate_inspect` and `plate-inspect --help` do not
# pay for torch: name -> module that defines it.
_LAZY = {
    "Bundle": "plate_inspect.bundle",
    "ModuleRecord": "plate_inspect.bundle",
    "ScanSettings": "plate_inspect.bundle",
    "BundleError": "plate_inspect.errors",
    "CheckpointError": "plate_inspect.errors",
    "ConfigError": "plate_inspect.errors",
    "PlateInspectError": "plate_inspect.errors",
    "apply_bundle": "plate_inspect.train.layer",
    "finish_meta_init": "plate_inspect.train.layer",
    "audit": "plate_inspect.auditing",
    "plan_budget": "plate_inspect.plan",
    "scan": "plate_inspect.scanner",
    "verify": "plate_inspect.verification",
}

__all__ = [
    "Bundle",
    "BundleError",
    "CheckpointError",
    "ConfigError",
    "ModuleRecord",
    "PlateInspectError",
    "ScanSettings",
    "__version__",
    "apply_bundle",
    "audit",
    "finish_meta_init",
    "plan_budget",
    "scan",
    "verify",
]


# Subpackages and modules a user reaches as attributes (``plate_inspect.embedded.default_model_path()``,
# ``pi.geometry.plate_geometry``), imported on first use too: without an import of their own they were an
# AttributeError after ``import plate_inspect``.
_SUBMODULES = frozenset(
    {
        "analysis",
        "auditing",
        "bundle",
        "checkpoint",
        "embedded",
        "errors",
        "experiments",
        "geometry",
        "health",
        "plan",
        "progress",
        "reports",
        "scanner",
        "targets",
        "testing",
        "train",
        "verification",
    }
)


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use (PEP 562); a submodule, imported on first use."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"plate_inspect.{name}")  # the import sets it as an attribute too
    raise AttributeError(f"module 'plate_inspect' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API and the submodules: what tab completion and ``dir(plate_inspect)`` show (``pi.emb<Tab>``)."""
    return [*__all__, *sorted(_SUBMODULES)]


if TYPE_CHECKING:  # static analysers and IDEs see the real objects
    from plate_inspect.auditing import audit
    from plate_inspect.bundle import Bundle, ModuleRecord, ScanSettings
    from plate_inspect.errors import BundleError, CheckpointError, ConfigError, PlateInspectError
    from plate_inspect.plan import plan_budget
    from plate_inspect.scanner import scan
    from plate_inspect.train.layer import apply_bundle, finish_meta_init
    from plate_inspect.verification import verify
