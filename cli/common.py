"""Shared CLI plumbing: the consoles."""

from __future__ import annotations

from rich.console import Console

from plate_inspect.formatting import human_bytes  # noqa: F401  (re-exported for the commands)

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
for _c in (console, err_console):  # piped or captured output: tables and progress need room, not 80 columns
    if not _c.is_terminal:
        _c.width = max(_c.width, 160)
