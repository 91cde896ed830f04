"""Deprecated import path, kept for one release: use ``plate_inspect.train.peft``."""

import warnings

from plate_inspect.train.peft import PlateConfig, PlateLayer, PlateModel  # noqa: F401

warnings.warn(
    "plate_inspect.peft is deprecated and goes in the next release: import from plate_inspect.train.peft",
    DeprecationWarning,
    stacklevel=2,
)
