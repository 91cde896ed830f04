#!/usr/bin/env bash
# The checks that need a GPU (issues 11 and 13), for a session that has the device machine. Logs go to $OUT (the
# folder the device tool brings back), else ./device-logs, written as each step goes (a step stopped by its time limit
# still leaves its log).
#
#   bash scripts/device_checks.sh tests   # pytest -m cuda: CUDA scan vs CPU + oracle, exactness grid (+TF32), layer
#   bash scripts/device_checks.sh train   # PLATE vs LoRA training step, bf16 autocast, peak memory
#   bash scripts/device_checks.sh steps   # per-module step times of the CUDA geometry, 7B and 1.5B shapes (~1 min)
#   bash scripts/device_checks.sh scan    # Qwen2.5-7B-shaped scan on CUDA (generates the 15 GB checkpoint first)
#   bash scripts/device_checks.sh scan2   # 2 layers of it on CUDA (3 GB to generate): a per-layer time, projected to 28
#   bash scripts/device_checks.sh quick   # tests, train, steps and scan2 in one call (the machine is handed back after
#                                         # ~30 s idle, and every fresh start costs minutes of the device budget)
#
# Time: a call may run 600 s. Each step runs under `timeout` (SIGINT first, so pytest still prints its summary):
# at most BUDGET seconds (default 540) counted from the script's start, and in `quick` at most its own cap
# (tests 240, train 150, steps 150, scan2 240 s), so that a slow or hung step leaves time to the next ones.
#
# Dry run on a machine without a GPU: DEVICE=cpu SMALL=1 bash scripts/device_checks.sh quick runs every step on the
# CPU with tiny sizes (the CUDA tests collect and skip; the benchmarks run their whole code path on a tiny model and
# the 'tiny' shape), in about a minute; tests/tooling/test_device_checks.py runs it. DEVICE (default cuda) is the benchmarks'
# --device; SMALL=1 shrinks sizes; without them the GPU run is unchanged.
#
# The device image already holds torch (CUDA), safetensors, peft, transformers, scipy, scikit-learn, rich and
# click; this project is installed on top without dependencies and without the network (skipped when this checkout
# already imports). PYTHON overrides the interpreter (default python3, the one that holds torch there).
set -euo pipefail
script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
usage="usage: bash scripts/device_checks.sh tests|train|steps|scan|scan2|quick"
step=${1:?$usage}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
small=${SMALL:-0}
budget=${BUDGET:-540}
logs=${OUT:-$repo/device-logs}
mkdir -p "$logs"
logs="$(cd "$logs" && pwd)"
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: nothing may wait on the hub

step_log() {  # the log file of step $1, e.g. bench_train_cuda.log (bench_train_cpu_small.log in the dry run)
    local tag=$device
    [ "$small" = 1 ] && tag="${device}_small"
    case "$1" in
        tests) echo "$logs/pytest_$tag.log" ;;
        train | steps | scan | scan2) echo "$logs/bench_${1}_$tag.log" ;;
    esac
}

run_step() {  # one step's commands; the caller has installed the project and chosen the working directory
    local log
    log=$(step_log "$1")
    case "$1" in
        tests)
            # only the files that hold CUDA tests: collecting the whole suite imports every test module (optional
            # packages the device image lacks, `from tests.x import` needing the repository root on sys.path), and
            # one collection error stops pytest before any test runs
            local files
            mapfile -t files < <(grep -l "pytest.mark.cuda" "$repo"/tests/*/test_*.py)
            "$py" -m pytest -m cuda -q -rs -p no:cacheprovider --durations=10 --rootdir "$repo" "${files[@]}" 2>&1 \
                | tee -i "$log" ;;
        train)
            local size=()
            [ "$small" = 1 ] && size=(--hidden 64 --intermediate 128 --layers 1 --vocab 256 --batch 2 --seq 16 --ranks 4
                                      --max-rank 32 --reps 2 --warmup 1 --workdir "$DEVICE_CHECKS_SCRATCH/train")
            "$py" "$repo/benchmarks/bench_train.py" --device "$device" --dtype bfloat16 --reps 20 --memory \
                "${size[@]}" 2>&1 | tee -i "$log" ;;
        steps)
            local shapes=(qwen2.5-7b qwen2.5-1.5b) repeat=2
            [ "$small" = 1 ] && shapes=(tiny) repeat=1
            (   rc=0  # one shape failing does not hide the next one's figures, nor its own failure
                for shape in "${shapes[@]}"; do
                    "$py" "$repo/benchmarks/bench_geometry_steps.py" --shape "$shape" --device "$device" \
                        --repeat "$repeat" || rc=$?
                done
                exit $rc
            ) 2>&1 | tee -i "$log" ;;
        scan | scan2)
            local shape=qwen2.5-7b layers=() work=/tmp/plate-bench
            [ "$1" = scan2 ] && layers=(--gen-layers 2)
            [ "$small" = 1 ] && shape=tiny work=$DEVICE_CHECKS_SCRATCH/scan
            "$py" "$repo/benchmarks/bench_scan.py" --shape "$shape" "${layers[@]}" --device "$device" \
                --workdir "$work" 2>&1 | tee -i "$log" ;;
        *) echo "unknown step '$1': use tests, train, steps, scan, scan2 or quick" >&2; return 2 ;;
    esac
}

if [ -n "${DEVICE_CHECKS_STEP:-}" ]; then  # a step run by the parent under `timeout`: the setup is done
    cd "$DEVICE_CHECKS_DIR"
    run_step "$DEVICE_CHECKS_STEP"
    exit
fi

case "$step" in tests | train | steps | scan | scan2 | quick) ;; *) echo "$usage" >&2; exit 2 ;; esac

# Install: skipped when this checkout's plate_inspect (with its cli) already imports; else pip, else a source tree.
imports_here() {
    (cd / && "$py" -c 'import os, sys, plate_inspect, plate_inspect.cli.main as m
repo = os.path.realpath(sys.argv[1]) + os.sep
sys.exit(0 if all(os.path.realpath(f).startswith(repo) for f in (plate_inspect.__file__, m.__file__)) else 1)' \
        "$repo") 2>/dev/null
}
workdir=$repo
scratch=$(mktemp -d)  # the small runs' models and bundles, the source tree of the fallback below; removed at the end
trap 'rm -rf "$scratch"' EXIT
if imports_here; then
    echo "plate_inspect already imports from $repo: not installed again" >"$logs/install.log"
elif ! { "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$logs/install.log" 2>&1 \
         && imports_here; }; then
    # e.g. an older setuptools than pyproject asks for: the same packages as a source tree on PYTHONPATH
    src=$scratch/src
    mkdir "$src"
    cp -r plate_inspect "$src/"
    ln -s "$repo/cli" "$src/plate_inspect/cli"
    ln -s "$repo/reports" "$src/plate_inspect/reports"
    export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
    workdir=$src  # `python -m` puts the working directory first: there the repository's plate_inspect/ (no cli/
                  # inside) would shadow this one
    echo "pip install failed (see install.log): using $src on PYTHONPATH" | tee -a "$logs/install.log"
fi
cd "$workdir"
"$py" - <<'EOF' 2>&1 | tee "$logs/device.txt"
import importlib, os, platform
import plate_inspect.cli.main, torch
print("plate_inspect from", plate_inspect.__file__)
print("python", platform.python_version(), "cpus", os.cpu_count())
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("numpy", "scipy", "safetensors", "sklearn", "transformers", "peft", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001 - a line in the log, not a failure
        print(name, "NOT IMPORTABLE:", e)
EOF

# Runs one step in a child of this script under `timeout` (SIGINT first, SIGKILL 20 s later), its output appended
# to the file $3 when given. Returns the step's exit status (124: stopped by its time limit).
timed_step() {
    local part=$1 cap=$2 sink=${3:-} left limit start rc=0 mode=$device
    [ "$small" = 1 ] && mode="$device, small"
    say() { echo "$*"; if [ -n "$sink" ]; then echo "$*" >>"$sink"; fi; }
    left=$((budget - SECONDS))
    limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        say "=== $part skipped: $left s left of BUDGET=$budget"
        return 124
    fi
    say "=== $part (limit $limit s, $mode)"
    start=$SECONDS
    local guard=(timeout -s INT -k 20 "$limit")
    command -v timeout >/dev/null || { say "=== (no timeout command: $part runs without its limit)"; guard=(); }
    local child=(env DEVICE_CHECKS_STEP="$part" DEVICE_CHECKS_DIR="$workdir" DEVICE_CHECKS_SCRATCH="$scratch"
                 "${guard[@]}" bash "$script" "$part")
    if [ -n "$sink" ]; then "${child[@]}" >>"$sink" 2>&1 || rc=$?; else "${child[@]}" || rc=$?; fi
    if [ "$rc" = 124 ]; then
        say "=== $part stopped at its time limit ($limit s)"
    elif [ "$rc" != 0 ]; then
        say "=== $part failed (exit $rc)"
    fi
    say "=== $part took $((SECONDS - start)) s"
    return "$rc"
}

if [ "$step" = quick ]; then  # each step logs on its own; one failing does not stop the others
    : >"$logs/quick.log"
    rc=0
    declare -A caps=([tests]=240 [train]=150 [steps]=150 [scan2]=240)
    for part in tests train steps scan2; do
        timed_step "$part" "${caps[$part]}" "$logs/quick.log" || rc=$?
    done
    echo "=== quick took $SECONDS s in all (exit $rc)" | tee -a "$logs/quick.log"
    for part in tests train steps scan2; do  # the results' last lines, in the device tool's output_tail too
        log=$(step_log "$part")
        if [ -f "$log" ]; then echo "--- $(basename "$log"), last lines:"; tail -n 12 "$log"; fi
    done
    exit "$rc"
fi
timed_step "$step" "$budget"
