"""scripts/device_checks.sh, the one command a session with a GPU machine runs: it must not break unnoticed.

A session is lent the GPU machine rarely, runs `bash scripts/device_checks.sh quick` once, and gets back what the
script wrote under $OUT. Here, without a GPU: (1) the GPU run's own commands with a stand-in interpreter that
passes the setup through to this Python, collects the CUDA tests (pytest --collect-only) and lets each benchmark
parse its arguments, then stops it; (2) the dry run (DEVICE=cpu SMALL=1) end to end, every step for real.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: What the device tool brings back from $OUT: at most 8 files, named in letters, digits, '.', '_' and '-'.
MAX_FILES = 8
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")

#: A benchmark run by the stand-in: argparse parses the script's arguments (exit 2 on an unknown or ill-typed one),
#: then the run stops before any work.
ARGS_ONLY = """
import argparse, os, runpy, sys
path = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(path))
parse = argparse.ArgumentParser.parse_args
def parse_then_stop(self, *args, **kwargs):
    ns = parse(self, *args, **kwargs)
    print("ARGS-OK", os.path.basename(path), vars(ns), flush=True)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
runpy.run_path(path, run_name="__main__")
"""

#: Stand-in for the device's python3: logs each call; the install check and the device report (unless FAKE_REPORT
#: is set: then that is the report) run for real;
#: pytest only collects; a benchmark only parses its arguments; pip must not be called (this checkout imports).
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/calls.log"
case "$1" in
  -c) exec "$REAL_PYTHON" "$@" ;;
  -) if [ -n "${FAKE_REPORT:-}" ]; then echo "$FAKE_REPORT"; exit 0; fi; exec "$REAL_PYTHON" - ;;
  -m) if [ "$2" = pytest ]; then shift 2; exec "$REAL_PYTHON" -m pytest --collect-only "$@"; fi
      echo "unexpected: python $*" >&2; exit 3 ;;
  *.py) exec "$REAL_PYTHON" -c "$ARGS_ONLY" "$@" ;;
esac
echo "unexpected: python $*" >&2; exit 3
"""


def _run(out: Path, step: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "SMALL", "BUDGET", "PYTHONPATH")}
    full_env.update({"OUT": str(out), **env})
    # as the device session runs it: from the repository root, by a relative path
    return subprocess.run(
        ["bash", "scripts/device_checks.sh", step],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _fake_python(tmp_path: Path) -> dict[str, str]:
    fake_dir = tmp_path / "fake"
    fake_dir.mkdir()
    fake = fake_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return {"PYTHON": str(fake), "FAKE_DIR": str(fake_dir), "REAL_PYTHON": sys.executable, "ARGS_ONLY": ARGS_ONLY}


def _assert_returnable(out: Path) -> list[str]:
    names = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()), names
    assert len(names) <= MAX_FILES and all(SAFE_NAME.fullmatch(n) for n in names), names
    return names


def test_gpu_quick_passes_arguments_the_benchmarks_accept_and_collects_the_cuda_tests(tmp_path):
    out = tmp_path / "out"
    env = {**_fake_python(tmp_path), "FAKE_REPORT": "torch stand-in"}  # the real report: the dry run below
    result = _run(out, "quick", env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "quick.log").read_text()
    for part in ("tests", "train", "steps", "scan2"):
        assert f"=== {part} (limit" in log and f"=== {part} took" in log, log
    assert "failed" not in log and "stopped" not in log, log

    # the GPU run's commands, unchanged by the dry-run switches: CUDA everywhere, the full sizes
    calls = (tmp_path / "fake" / "calls.log").read_text().splitlines()
    bench = [c.split()[0].rsplit("/", 1)[-1] + " " + " ".join(c.split()[1:]) for c in calls if ".py" in c.split()[0]]
    assert bench == [
        "bench_train.py --device cuda --dtype bfloat16 --reps 20 --memory",
        "bench_geometry_steps.py --shape qwen2.5-7b --device cuda --repeat 2",
        "bench_geometry_steps.py --shape qwen2.5-1.5b --device cuda --repeat 2",
        "bench_scan.py --shape qwen2.5-7b --gen-layers 2 --device cuda --workdir /tmp/plate-bench",
    ], calls
    assert not any(c.startswith("-m pip") for c in calls), calls  # this checkout imports: no install

    # each benchmark parsed them (a renamed flag exits 2 before this line)
    assert log.count("ARGS-OK bench_train.py") == 1
    assert log.count("ARGS-OK bench_geometry_steps.py") == 2
    assert log.count("ARGS-OK bench_scan.py") == 1
    # the CUDA tests collect without errors: those of test_cuda.py and the PLATE layer's
    pytest_log = (out / "pytest_cuda.log").read_text()
    assert "error" not in pytest_log.lower(), pytest_log
    collected = re.search(r"(\d+)/(\d+) tests collected", pytest_log)
    assert collected and int(collected[1]) >= 50, pytest_log
    assert "tests/geometry/test_cuda.py::test_cuda_geometry_is_exact_at_qwen_7b_sizes[gate-7b-True]" in pytest_log
    assert "tests/train/test_layer.py::test_cuda_forward_merge_match_cpu" in pytest_log
    # the results' last lines also on stdout (the device tool's output_tail), the collection's count among them
    assert "--- pytest_cuda.log, last lines:" in result.stdout and collected[0] in result.stdout, result.stdout
    names = _assert_returnable(out)
    assert names == sorted(
        [
            "install.log",
            "device.txt",
            "quick.log",
            "pytest_cuda.log",
            "bench_train_cuda.log",
            "bench_steps_cuda.log",
            "bench_scan2_cuda.log",
        ]
    )


def test_steps_past_the_budget_are_skipped_and_logged(tmp_path):
    out = tmp_path / "out"
    result = _run(out, "quick", {**_fake_python(tmp_path), "BUDGET": "5", "FAKE_REPORT": "torch stand-in"}, timeout=300)
    assert result.returncode == 124, result.stdout + result.stderr
    log = (out / "quick.log").read_text()
    for part in ("tests", "train", "steps", "scan2"):
        assert re.search(rf"=== {part} skipped: -?\d+ s left of BUDGET=5", log), log
    calls = (tmp_path / "fake" / "calls.log").read_text()
    assert ".py" not in calls and "pytest" not in calls, calls


def test_an_unknown_step_is_one_usage_line(tmp_path):
    result = _run(tmp_path / "out", "scna2", {"PYTHON": "false"}, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "usage: bash scripts/device_checks.sh tests|train|steps|scan|scan2|quick"


@pytest.mark.slow
def test_dry_run_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"DEVICE": "cpu", "SMALL": "1", "PYTHON": sys.executable, "TMPDIR": str(scratch)}
    result = _run(out, "quick", env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "quick.log").read_text()
    assert "failed" not in log and "stopped" not in log, log
    assert "torch" in (out / "device.txt").read_text()

    # the CUDA tests collect and skip (no GPU here); none errors, none runs
    pytest_log = (out / "pytest_cpu_small.log").read_text()
    summary = pytest_log.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped, \d+ deselected in [\d.]+s( \(.*\))?", summary), pytest_log
    assert int(summary.split()[0]) >= 50
    # every benchmark ran to its last line
    train = (out / "bench_train_cpu_small.log").read_text()
    assert re.search(r"r = 4: trainable PLATE [\d,]+", train), train
    for method in ("plate", "lora", "lora_r"):
        assert re.search(rf"^  {method}\S* +step .* peak training memory", train, re.M), train
    steps = (out / "bench_steps_cpu_small.log").read_text()
    assert "per layer (compute only): floor" in steps, steps
    scan = (out / "bench_scan2_cpu_small.log").read_text()
    assert re.search(r"streaming scan, all layers: .* modules 14 ", scan), scan  # 2 layers x 7 projections

    _assert_returnable(out)
    # the script's scratch directory (models, bundles, checkpoint) is gone
    assert not [p for p in scratch.iterdir() if p.name.startswith("tmp.")], list(scratch.iterdir())
