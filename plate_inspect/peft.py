"""Deprecated import path, kept for one release: use ``plate_inspect.train.peft``."""

from plate_inspect.train.peft import PlateConfig, PlateLayer, PlateModel  # noqa: F401
