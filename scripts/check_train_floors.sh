#!/usr/bin/env bash
# Is the train extra's floor true? Builds build/venv-train-floor/ (VENV= to choose) with the oldest trainer stack
# pyproject.toml allows (transformers 4.56.2: what trl 1.16 requires; peft 0.21.0, trl 1.16.0) and runs the trainer
# tests there (the files check_floors.sh leaves out), their slow ones included (TRL, DDP/FSDP2). Run by hand when a train floor or the trainer code changes;
# not part of CI (measured from scratch on the loaded 2-core machine: see README "Supported versions").
#   bash scripts/check_train_floors.sh                        # build (if missing) and run the trainer tests
#   TRANSFORMERS=4.57.6 VENV=build/venv-train-457 bash scripts/check_train_floors.sh   # another transformers
#   bash scripts/check_train_floors.sh tests/train/test_peft.py -k moe   # pytest arguments replace the default list
# torch stays at the CPU build 2.13.0 (other builds are multi-GB CUDA downloads); the runtime dependencies are the
# newest that the trainer stack allows (transformers 4.x needs huggingface_hub < 1.0): their floors are
# scripts/check_floors.sh's business.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VENV:-build/venv-train-floor}  # build/ is ignored by git
FLOORS=("torch==2.13.0" "transformers==${TRANSFORMERS:-4.56.2}" "peft==0.21.0" "trl==1.16.0")
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  printf '%s\n' "${FLOORS[@]}" > "$VENV/floors.txt"
  # the constraints keep the floors (and keep pip from pulling another torch)
  "$VENV/bin/python" -m pip install -q -c "$VENV/floors.txt" "${FLOORS[@]}" "setuptools>=77"
  "$VENV/bin/python" -m pip install -q -c "$VENV/floors.txt" -e ".[minilm,train,dev]"
  # curvlinops -> backpack pulls a torchvision built for another torch (it breaks transformers' model imports), and
  # weightwatcher sentence-transformers: removed, as scripts/bootstrap.sh and check_floors.sh do
  "$VENV/bin/python" -m pip uninstall -q -y sentence-transformers torchvision || true
fi
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|trl|accelerate|datasets|huggingface.hub) '
if [ "$#" -eq 0 ]; then
  # the trainer tests: the files scripts/check_floors.sh leaves out, but the CUDA, device-check and browser ones;
  # -m replaces pyproject's "not slow and not cuda", so the slow TRL and DDP/FSDP2 tests run too (not the inductor
  # compile test: minutes of C++ compiling that depend on torch, not on the train extra)
  set -- $(ls tests/*/test_*.py | grep -E '/test_(peft|trl|layer|peft_usage|meta_init|ddp|train_speed_orders|sequential|continual|arena|plan_training|curvature|alignment|layers_stacks|weightcheck|variants|quant)\.py') \
    -m "not cuda" --deselect tests/train/test_train_speed_orders.py::test_torch_compile_inductor_matches_eager
fi
exec nice "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
