"""Distributed training on CPU (gloo): torchrun with the transformers Trainer, accelerate and FSDP2 (also from meta).

Every rank must hold identical B/Q, gradients must all-reduce (A equal on every rank), and the result must match a
single-process run on the same data. Each case starts 2 processes (tens of seconds): marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import save_tiny_qwen2

from plate_inspect import scan

WORKER = Path(__file__).resolve().parents[1] / "ddp_worker.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    save_tiny_qwen2(root / "model")
    scan(root / "model", root / "bundle", r=4, tau=0.8, max_rank=16)
    single = root / "single"
    _run([sys.executable, str(WORKER), "single", str(root / "model"), str(root / "bundle"), str(single)])
    return root, torch.load(single / "rank0.pt")


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


def _torchrun(mode: str, root: Path) -> list[dict]:
    out = root / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run([*cmd, str(WORKER), mode, str(root / "model"), str(root / "bundle"), str(out)])
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("mode", ["trainer", "accelerate", "fsdp2", "accelerate_fsdp2", "fsdp2_meta"])
def test_two_ranks_match_one_process(tiny, mode):
    root, single = tiny
    ranks = _torchrun(mode, root)
    assert [s["world"] for s in ranks] == [2, 2]
    assert ranks[0]["bq"] == ranks[1]["bq"] == single["bq"]  # identical B/Q everywhere
    assert set(ranks[0]["A"]) == set(single["A"]) and len(single["A"]) == 14
    for name, a in single["A"].items():
        assert a.abs().sum() > 0
        torch.testing.assert_close(ranks[0]["A"][name], ranks[1]["A"][name], rtol=0, atol=0)  # all-reduced
        torch.testing.assert_close(ranks[0]["A"][name], a, rtol=1e-4, atol=1e-6)  # = single process
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-4, atol=1e-5)
