"""Human-readable figures shared by the CLI and the reports."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.23 MB'`` (decimal units, as disk and download sizes are quoted)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``(1, 'module')`` -> ``'1 module'``, ``(14, 'module')`` -> ``'14 modules'`` (``plural`` for irregular nouns)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
