"""What importing a module pulls in: the oracle of the tests that keep modules importable on their own (no cycle)
and light (no torch, transformers or checkpoint reader where none is needed)."""

from __future__ import annotations

import subprocess
import sys


def modules_after_import(module: str) -> set[str]:
    """The names in sys.modules after importing ``module`` first in a fresh interpreter."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())
