"""Distributed scans: torchrun ranks and spawned device workers give the single-process bundle, byte for byte."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_distributed import EXE, ONE_THREAD, run, torchrun
from oracles import assert_same_bundle

import plate_inspect
from plate_inspect.distributed import RankInfo, assign_parts, module_cost, parse_devices, rank_device, rank_from_env
from plate_inspect.errors import BundleError, ConfigError


@pytest.fixture(scope="module")
def reference(four_layers, tmp_path_factory):
    """The single-process bundle with one thread per process (the threads every rank below uses)."""
    out = tmp_path_factory.mktemp("ref") / "b"
    run([EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8", "--quiet"])
    return out


# --------------------------------------------------------------------------- sharing the work
def test_assign_parts_is_a_partition_within_the_lpt_bound_of_the_optimum():
    costs = [("a", 7.0), ("b", 5.0), ("c", 4.0), ("d", 4.0), ("e", 3.0), ("f", 3.0), ("g", 2.0)]
    for world in (1, 2, 3):
        shares = assign_parts(costs, world)
        assert shares == assign_parts(costs, world)  # deterministic
        assert sorted(itertools.chain(*shares)) == sorted(n for n, _ in costs)  # every part exactly once
        cost = dict(costs)
        for share in shares:  # each rank's parts in plan order
            assert share == sorted(share)
        worst = max(sum(cost[n] for n in share) for share in shares)
        # brute force: the best possible largest load over every assignment of parts to ranks
        best = min(
            max(sum(c for (_, c), r in zip(costs, ranks, strict=True) if r == k) for k in range(world))
            for ranks in itertools.product(range(world), repeat=len(costs))
        )
        assert worst <= best * 4 / 3
    # by hand: a7->0, b5->1, c4->1 (9), d4->0 (11), e3->1 (12), f3->0 (14), g2->1 (14)
    assert assign_parts(costs, 2) == [["a", "d", "f"], ["b", "c", "e", "g"]]
    assert assign_parts([("x", 1.0)], 3) == [["x"], [], []]


def test_module_cost_counts_the_small_side():
    assert module_cost(100, 400) == module_cost(400, 100) == 100 * 100 * 400 + 2 * 100**3


def test_rank_from_env_and_devices_refuse_nonsense(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="RANK=2"):
        rank_from_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        rank_from_env()
    with pytest.raises(ConfigError, match="not cpu or cuda"):
        parse_devices("cpu,tpu:0")
    with pytest.raises(ConfigError, match="twice"):
        parse_devices(["cuda:0", "cuda:0"])
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]


# --------------------------------------------------------------------------- end to end
def test_torchrun_two_ranks_write_the_single_process_bundle(four_layers, reference, tmp_path):
    out = tmp_path / "b"
    # torchrun's own parser would take "--r" as an abbreviation of its options: everything after -- is ours
    run(torchrun("--no-python", "--", EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8", "--quiet"))
    assert_same_bundle(reference, out)
    stats = json.loads((out / "scan_stats.json").read_text())
    assert stats["world_size"] == 2 and len(stats["ranks"]) == 2
    assert sorted(s["modules_scanned"] for s in stats["ranks"]) == [14, 14]  # equal shapes: two layers each
    assert stats["bytes_read"] == sum(s["bytes_read"] for s in stats["ranks"])


@pytest.mark.slow
def test_devices_workers_write_the_single_process_bundle(four_layers, reference, tmp_path):
    out = tmp_path / "b"
    run([sys.executable, "-m", "plate_inspect", "scan", str(four_layers.path), "--out", str(out), "--r", "8",
         "--devices", "cpu,cpu", "--quiet"])  # fmt: skip
    assert_same_bundle(reference, out)


_KILL_RANK_1 = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import plate_inspect

    def kill_rank_1(event):
        if os.environ["RANK"] == "1" and event.done == 9:  # in its second part
            # its first part (layer 1) went to the part-writer thread at done == 7: die once it is on disk
            deadline = time.monotonic() + 60
            while not (Path(sys.argv[2]) / "layer-00001.safetensors").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

    plate_inspect.scan(sys.argv[1], sys.argv[2], r=8, progress=kill_rank_1)
    """
)


@pytest.mark.slow
def test_killed_rank_resumes_to_the_same_bundle(four_layers, reference, tmp_path):
    out = tmp_path / "b"
    script = tmp_path / "kill_rank_1.py"
    script.write_text(_KILL_RANK_1)
    died = run(torchrun(str(script), str(four_layers.path), str(out)), check=False)
    assert died.returncode != 0
    with pytest.raises(BundleError, match="incomplete"):
        plate_inspect.Bundle.load(out)
    assert (out / "layer-00001.safetensors").exists()  # rank 1's first part survived its death
    run(torchrun("--no-python", "--", EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8", "--quiet"))
    assert_same_bundle(reference, out)
    stats = json.loads((out / "scan_stats.json").read_text())
    assert stats["modules_resumed"] >= 7 and stats["modules_resumed"] + stats["modules_scanned"] == 28


_DISAGREE = textwrap.dedent(
    """
    import json, os, sys
    from plate_inspect import distributed
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.errors import ConfigError
    from plate_inspect.scanner import plan_scan

    rank = int(os.environ["RANK"])
    cases = {  # rank 1's settings for each case; rank 0 always scans with r=8 over every layer
        "same": {"r": 8},
        "r": {"r": 16},
        "layers": {"r": 8, "layers": (0, 1)},
    }
    verdicts = {}
    with distributed.join() as group:
        for case, kw in cases.items():
            plan = plan_scan(sys.argv[1], ScanSettings(**(kw if rank == 1 else {"r": 8})))
            try:
                group.agree(distributed.plan_identity(plan), "the scan plan")
                verdicts[case] = "agreed"
            except ConfigError as e:
                verdicts[case] = str(e)
    print("VERDICTS " + json.dumps(verdicts), flush=True)
    """
)


@pytest.mark.slow
def test_ranks_that_planned_different_scans_are_told_so_on_every_rank(four_layers, tmp_path):
    """Rank 1 started with another --r or --layers: every rank gets one ConfigError naming what differs (the old
    run went on: with rank 0's r silently, or scanning its own share of another plan and leaving 7 modules
    unwritten); the same plan on both ranks agrees."""
    script = tmp_path / "disagree.py"
    script.write_text(_DISAGREE)
    out = run(torchrun(str(script), str(four_layers.path))).stdout
    # the two ranks' prints may interleave in torchrun's merged stdout: decode each JSON object after its marker
    decoder = json.JSONDecoder()
    verdicts = [decoder.raw_decode(chunk)[0] for chunk in out.split("VERDICTS ")[1:]]
    assert len(verdicts) == 2 and verdicts[0] == verdicts[1]  # every rank hears the same verdict
    v = verdicts[0]
    assert v["same"] == "agreed"
    assert v["r"].startswith("ranks disagree on the scan plan: settings.r is 8 on rank 0 but 16 on rank 1")
    assert "modules is '28 modules, " in v["layers"] and "'14 modules, " in v["layers"]
    assert "same command line" in v["layers"]


_DISAGREEING_SCAN = textwrap.dedent(
    """
    import os, sys
    from plate_inspect.errors import ConfigError
    from plate_inspect.scanner import scan

    rank = int(os.environ["RANK"])
    try:
        scan(sys.argv[1], sys.argv[2], r=8 if rank == 0 else 16)
        print(f"RANK {rank} scanned", flush=True)
    except ConfigError as e:
        print(f"RANK {rank} refused: {e}", flush=True)
    """
)


@pytest.mark.slow
def test_scan_with_ranks_started_differently_is_refused_before_writing(four_layers, tmp_path):
    """run_scan asks every rank to agree on its plan first: rank 1 with another r used to scan with rank 0's r
    silently; now both ranks are refused and the output directory holds no bundle."""
    script = tmp_path / "disagreeing_scan.py"
    script.write_text(_DISAGREEING_SCAN)
    out = tmp_path / "b"
    stdout = run(torchrun(str(script), str(four_layers.path), str(out))).stdout
    # the two ranks' lines may interleave in torchrun's merged stdout: find each rank's verdict, not lines
    verdicts = sorted(
        re.findall(
            r"RANK (\d) (refused: ranks disagree on the scan plan: settings\.r is 8 on rank 0 "
            r"but 16 on rank 1|scanned)",
            stdout,
        )
    )
    assert [rank for rank, _ in verdicts] == ["0", "1"] and all(v.startswith("refused") for _, v in verdicts), stdout
    assert not (out / "manifest.json").exists() and not list(out.glob("layer-*.safetensors"))


_SLOW_DEVICES_SCAN = textwrap.dedent(
    """
    import sys, time
    import plate_inspect.scanner as scanner

    _compute = scanner._compute

    def slow_compute(*args, **kwargs):  # module level: spawned workers re-import this file, so they are slow too
        time.sleep(1.0)
        yield from _compute(*args, **kwargs)

    scanner._compute = slow_compute

    if __name__ == "__main__":
        scanner.scan(sys.argv[1], sys.argv[2], r=8, devices="cpu,cpu")
    """
)


@pytest.mark.slow
def test_devices_workers_die_with_their_parent(four_layers, tmp_path):
    """Killing the process that runs a --devices scan (kill, a job manager's SIGKILL) used to leave its workers
    scanning on as orphans (holding their GPUs) until they finished the bundle; now they die with it, and the
    bundle stays unfinished for a rerun to resume."""
    import signal
    import time

    script = tmp_path / "slow_devices.py"
    script.write_text(_SLOW_DEVICES_SCAN)
    out = tmp_path / "b"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    parent = subprocess.Popen([sys.executable, str(script), str(four_layers.path), str(out)], env={**env, **ONE_THREAD})
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("layer-*.safetensors")) and time.monotonic() < deadline:  # workers are scanning
            time.sleep(0.05)
        workers = [int(p) for p in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()]
        workers = [w for w in workers if "spawn_main" in Path(f"/proc/{w}/cmdline").read_text()]
        assert len(workers) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5  # a worker needs 7 s per part: dying here is not finishing
        while any(Path(f"/proc/{w}").exists() and _state(w) != "Z" for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{w}").exists() and _state(w) != "Z" for w in workers)
    finally:
        parent.kill()
    with pytest.raises(BundleError, match="incomplete"):  # 4 parts x 7 modules x 1 s: far from done
        plate_inspect.Bundle.load(out)


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie, dead but not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_a_rank_bound_to_a_gpu_of_its_own_is_told_to_give_cuda_0(monkeypatch):
    """`--device cuda` gives rank N cuda:LOCAL_RANK. A scheduler that binds one GPU to each rank (Slurm's
    --gpus-per-task=1) shows each rank only its own, as cuda:0: rank 3 was told to run one process per GPU, which it
    did. The line now names CUDA_VISIBLE_DEVICES and --device cuda:0 (an explicit index is kept on every rank)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rank_3 = RankInfo(rank=3, world_size=4, local_rank=3, local_world_size=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError) as bound:
        rank_device(torch.device("cuda"), rank_3)
    assert str(bound.value) == (
        "rank 3 has LOCAL_RANK=3 but this process sees 1 CUDA device (CUDA_VISIBLE_DEVICES=3: if the scheduler gives "
        "each rank a GPU of its own, give --device cuda:0); run at most one process per GPU (--nproc-per-node)"
    )
    assert rank_device(torch.device("cuda:0"), rank_3) == torch.device("cuda:0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"^rank 3 has LOCAL_RANK=3 but this process sees 2 CUDA devices; run at"):
        rank_device(torch.device("cuda"), rank_3)
    assert rank_device(torch.device("cuda"), RankInfo(1, 4, 1, 4)) == torch.device("cuda", 1)
