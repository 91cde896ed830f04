#!/usr/bin/env bash
# The checks that need a GPU (issues 11 and 13), for a session that has the device machine. One step per call,
# since a call may run 10 minutes; logs go to $OUT (the folder the device tool brings back), else ./device-logs.
#
#   bash scripts/device_checks.sh tests   # pytest -m cuda: CUDA scan vs CPU + oracle, exactness grid (+TF32), PLATE layer
#   bash scripts/device_checks.sh train   # PLATE vs LoRA training step, bf16 autocast, peak memory
#   bash scripts/device_checks.sh steps   # per-module step times of the CUDA geometry, 7B and 1.5B shapes (~1 min)
#   bash scripts/device_checks.sh scan    # Qwen2.5-7B-shaped scan on CUDA (generates the 15 GB checkpoint first)
#   bash scripts/device_checks.sh scan2   # 2 layers of it on CUDA (3 GB to generate): a per-layer time, projected to 28
#   bash scripts/device_checks.sh quick   # tests, train, steps and scan2 in one call (the machine is handed back after
#                                         # ~30 s idle, and every fresh start costs minutes of the device budget)
#
# The device image already holds torch (CUDA), safetensors, peft, transformers, scipy, scikit-learn, rich and
# click; this project is installed on top without dependencies and without the network. PYTHON overrides the
# interpreter (default python3, the one that holds torch there).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
step=${1:?usage: bash scripts/device_checks.sh tests|train|steps|scan|scan2|quick}
py=${PYTHON:-python3}
logs=${OUT:-$PWD/device-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1

if ! "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$logs/install.log" 2>&1; then
    # e.g. an older setuptools than pyproject asks for: the same packages as a source tree on PYTHONPATH
    src=$(mktemp -d)
    cp -r plate_inspect "$src/"
    ln -s "$PWD/cli" "$src/plate_inspect/cli"
    ln -s "$PWD/reports" "$src/plate_inspect/reports"
    export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
    cd "$src"  # so that the repository's own plate_inspect/ (no cli/ inside) does not shadow it
    echo "pip install failed (see install.log): using $src on PYTHONPATH" | tee -a "$logs/install.log"
fi
"$py" - <<'EOF' 2>&1 | tee "$logs/device.txt"
import plate_inspect.cli.main, torch
print("plate_inspect from", plate_inspect.__file__)
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
EOF

if [ "$step" = quick ]; then  # each step logs on its own; one failing does not stop the others
    rc=0
    for part in tests train steps scan2; do
        echo "=== $part" | tee -a "$logs/quick.log"
        SECONDS=0
        bash "$0" "$part" >>"$logs/quick.log" 2>&1 || { rc=$?; echo "=== $part failed (exit $rc)" | tee -a "$logs/quick.log"; }
        echo "=== $part took ${SECONDS} s" | tee -a "$logs/quick.log"
    done
    exit "$rc"
fi

case "$step" in
    tests) "$py" -m pytest -m cuda -q -p no:cacheprovider "$repo/tests" 2>&1 | tee "$logs/pytest_cuda.log" ;;
    train) "$py" "$repo/benchmarks/bench_train.py" --device cuda --dtype bfloat16 --reps 20 --memory 2>&1 \
               | tee "$logs/bench_train_cuda.log" ;;
    steps) for shape in qwen2.5-7b qwen2.5-1.5b; do
               "$py" "$repo/benchmarks/bench_geometry_steps.py" --shape "$shape" --device cuda --repeat 2
           done 2>&1 | tee "$logs/bench_steps_cuda.log" ;;
    scan) "$py" "$repo/benchmarks/bench_scan.py" --shape qwen2.5-7b --device cuda --workdir /tmp/plate-bench 2>&1 \
              | tee "$logs/bench_scan_cuda.log" ;;
    scan2) "$py" "$repo/benchmarks/bench_scan.py" --shape qwen2.5-7b --gen-layers 2 --device cuda \
               --workdir /tmp/plate-bench 2>&1 | tee "$logs/bench_scan2_cuda.log" ;;
    *) echo "unknown step '$step': use tests, train, steps, scan, scan2 or quick" >&2; exit 2 ;;
esac
