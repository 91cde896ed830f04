"""Shared CLI plumbing: the console, human-readable sizes."""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
for _c in (console, err_console):  # piped or captured output: tables and progress need room, not 80 columns
    if not _c.is_terminal:
        _c.width = max(_c.width, 160)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
