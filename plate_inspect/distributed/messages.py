"""Wording shared by the job's one-line messages."""

from __future__ import annotations

from plate_inspect.errors import PlateInspectError

RESUME = "the part files finished so far are kept: rerun the same command to resume (with any number of ranks)"


def one_line(error: BaseException) -> str:
    """An exception as one short line: its type (for non-plate-inspect errors) and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(error, PlateInspectError):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
