"""scripts/bootstrap.sh run against a stand-in .venv/bin/python: a failed pip install must fail the bootstrap."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Stand-in interpreter: logs each call; `pip install -e ...` fails when FAIL_EDITABLE is set; imports succeed.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$* PYTHONWARNINGS=${PYTHONWARNINGS:-}" >> "$(dirname "$0")/calls.log"
case "$*" in
  *"pip install"*"-e"*) if [ -n "${FAIL_EDITABLE:-}" ]; then echo "ERROR: No matching distribution" >&2; exit 1; fi ;;
  *"torch.__version__"*) exit 0 ;;
esac
exit 0
"""


def _project_copy(tmp_path: Path) -> Path:
    """A project dir holding the real bootstrap script, its inputs, and a fake .venv/bin/python."""
    root = tmp_path / "project"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap.sh", root / "scripts" / "bootstrap.sh")
    shutil.copy(REPO / "scripts" / "constraints.txt", root / "scripts" / "constraints.txt")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return root


def _bootstrap(root: Path, **env: str) -> subprocess.CompletedProcess:
    # A do-nothing apt-get first on PATH: as root without Fashion-MNIST, the script's dataset step would call it.
    fake_bin = root / "fake-bin"
    fake_bin.mkdir(exist_ok=True)
    apt = fake_bin / "apt-get"
    apt.write_text("#!/usr/bin/env bash\nexit 0\n")
    apt.chmod(apt.stat().st_mode | stat.S_IXUSR)
    full_env = {**os.environ, **env, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", str(root / "scripts" / "bootstrap.sh")], env=full_env, capture_output=True, text=True, timeout=60
    )


def test_bootstrap_fails_and_leaves_no_stamp_when_pip_install_fails(tmp_path):
    root = _project_copy(tmp_path)
    result = _bootstrap(root, FAIL_EDITABLE="1")
    assert result.returncode != 0
    assert "No matching distribution" in result.stderr
    assert "failed (exit 1)" in result.stderr
    assert not (root / ".venv" / ".plate-inspect-installed").exists()


def test_bootstrap_succeeds_and_stamps_when_pip_succeeds(tmp_path):
    root = _project_copy(tmp_path)
    result = _bootstrap(root)
    assert result.returncode == 0, result.stderr
    assert (root / ".venv" / ".plate-inspect-installed").exists()
    calls = (root / ".venv" / "bin" / "calls.log").read_text().splitlines()
    editable = [c for c in calls if "pip install" in c and "-e" in c.split()]
    assert len(editable) == 1
    # The editable install runs with setuptools' banner silenced, through the quiet_pip wrapper.
    assert editable[0].endswith("PYTHONWARNINGS=ignore:Editable installation")


def test_bootstrap_refuses_up_front_when_the_disk_is_nearly_full(tmp_path):
    # A stand-in df reporting 500 MB free: the bootstrap must stop before pip with a line saying how much it needs,
    # not let pip fail half-way ("No space left on device", as a CI run once did).
    root = _project_copy(tmp_path)
    fake_bin = root / "fake-bin"
    fake_bin.mkdir()
    df = fake_bin / "df"
    df.write_text("#!/usr/bin/env bash\necho 'Filesystem 1k-blocks Used Available'\necho 'x 9 9 512000'\n")
    df.chmod(df.stat().st_mode | stat.S_IXUSR)
    result = _bootstrap(root)
    assert result.returncode == 1
    assert "only 500 MB free" in result.stderr and "needs ~2.1 GB" in result.stderr
    assert not (root / ".venv" / "bin" / "calls.log").exists()  # pip never ran
    assert not (root / ".venv" / ".plate-inspect-installed").exists()
