"""plate-inspect: offline PLATE geometry for safetensors checkpoints, shipped as PLATE init bundles.

Main entry points::

    import plate_inspect
    bundle = plate_inspect.scan("Qwen/Qwen2.5-7B", out="bundles/qwen7b", tau=0.9)
    bundle = plate_inspect.Bundle.load("bundles/qwen7b")
    b_idx, q = bundle.b_idx(name), bundle.q(name)
    trainable = plate_inspect.apply_bundle(model, bundle, rho=0.5)   # PLATE layers, weights checked
"""

__version__ = "0.1.0"

from plate_inspect.audit import audit  # noqa: E402  (beyond, issue 15)
from plate_inspect.bundle import Bundle, ModuleRecord, ScanSettings  # noqa: E402
from plate_inspect.errors import BundleError, CheckpointError, ConfigError, PlateInspectError  # noqa: E402
from plate_inspect.plan import plan_budget  # noqa: E402  (beyond, issue 15)
from plate_inspect.scanner import scan  # noqa: E402
from plate_inspect.train.layer import apply_bundle  # noqa: E402
from plate_inspect.verify import verify  # noqa: E402

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
    "plan_budget",
    "scan",
    "verify",
]
