"""Errors that describe a user mistake or bad input; the CLI prints them on one line, without a traceback."""

from __future__ import annotations


class PlateInspectError(Exception):
    """Base class: the message says what went wrong, where (file/tensor), and what to do."""


class CheckpointError(PlateInspectError):
    """The checkpoint cannot be found, read, or is not what it claims to be."""


class UnsupportedWeightError(CheckpointError):
    """A weight is stored in a form plate-inspect does not analyse (quantized, integer, fp8, pickle)."""


class BundleError(PlateInspectError):
    """A bundle is missing, incomplete, corrupt, or made for other weights or settings."""


class ConfigError(PlateInspectError):
    """A setting is out of range or inconsistent."""
