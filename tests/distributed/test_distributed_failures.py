"""Distributed scans when something goes wrong: a rank that fails, stops or scans other weights, a bad environment.

Each end-to-end case runs a real torchrun job on CPU (gloo) over a small checkpoint; the unit cases drive the
:class:`~plate_inspect.distributed.Coordinator` over a real TCPStore, one thread per rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
from helpers_distributed import CLI_RANK_1_KILLED, EXE, JOB_VARS, ONE_THREAD, run, torchrun
from oracles import assert_same_bundle

from plate_inspect import distributed
from plate_inspect.bundle import Bundle
from plate_inspect.distributed import Coordinator, RankInfo, rank_from_env
from plate_inspect.errors import BundleError, ConfigError
from plate_inspect.testing.synthetic import write_llama_like


# --------------------------------------------------------------------------- the environment
def test_env_without_master_port_or_with_rank_alone_is_one_clear_line(monkeypatch):
    """WORLD_SIZE and MASTER_ADDR without MASTER_PORT used to get past rank_from_env and fail in torch's env://
    rendezvous with a ValueError traceback; RANK=1 alone was 'RANK=1 is not a rank of WORLD_SIZE=1', which does
    not say that WORLD_SIZE is missing. RANK=0 alone (set by some job managers) is a single process."""
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 but MASTER_PORT is unset: launch distributed scans with"):
        rank_from_env()
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ConfigError, match=r"MASTER_ADDR and MASTER_PORT are unset"):
        rank_from_env()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"RANK=1 is set but WORLD_SIZE is not \(torchrun sets both\): unset RANK"):
        rank_from_env()
    monkeypatch.setenv("RANK", "0")
    assert rank_from_env() == RankInfo(0, 1, 0)


def test_cli_names_the_missing_master_port(four_layers, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(ONE_THREAD, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1")
    proc = subprocess.run([EXE, "scan", str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "error: WORLD_SIZE=2 but MASTER_PORT is unset" in proc.stderr


# --------------------------------------------------------------------------- the coordinator over a real store
@pytest.fixture
def store():
    """A TCPStore server on a free port (what torchrun's agent or rank 0 holds), and a factory for clients."""
    port = distributed.devices._free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)

    def client() -> torch.distributed.TCPStore:
        return torch.distributed.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))

    yield server, client


@pytest.fixture
def fast_silence(monkeypatch):
    monkeypatch.setattr(distributed.timing, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(distributed.timing, "SILENCE_LIMIT_SECONDS", 1.0)
    monkeypatch.setattr(distributed.timing, "POLL_SECONDS", 0.02)


def test_a_rank_that_went_silent_is_named_within_the_silence_limit(store, fast_silence):
    """Rank 1 never arrives and never beats (killed, SIGSTOPped, its node lost): rank 0 used to wait at the gather
    for gloo's timeout (24 h here); now it names rank 1 after the silence limit (1 s in this test)."""
    server, _ = store
    root = Coordinator(RankInfo(0, 2, 0), server, "t/")
    try:
        started = time.monotonic()
        with pytest.raises(BundleError, match=r"^rank 1 has given no sign of life for 1 s .*rerun the same command"):
            root._arrive()
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        root.close()


def test_a_slow_rank_that_beats_is_waited_for(store, fast_silence):
    """Rank 1 arrives 3 silence limits late but beats all along: no error, rank 0 just waits."""
    server, client = store
    root, other = Coordinator(RankInfo(0, 2, 0), server, "t/"), Coordinator(RankInfo(1, 2, 1), client(), "t/")
    try:
        late = threading.Timer(3.0, other._arrive)
        late.start()
        started = time.monotonic()
        root._arrive()
        assert time.monotonic() - started >= 2.9
        late.join()
    finally:
        root.close()
        other.close()


def test_a_rank_that_failed_is_named_on_the_waiting_rank_with_its_error(store, fast_silence):
    """Rank 1's own error (a part it cannot write) reaches rank 0 at once, as one line with rank 1's message."""
    server, client = store
    root, other = Coordinator(RankInfo(0, 2, 0), server, "t/"), Coordinator(RankInfo(1, 2, 1), client(), "t/")
    try:
        other.report_failure(BundleError("/shared/b/layer-00001.safetensors: cannot write (No space left on device)"))
        started = time.monotonic()
        with pytest.raises(BundleError) as caught:
            root._arrive()
        assert time.monotonic() - started < 0.9  # not the silence limit: the error was posted
        assert str(caught.value) == (
            "rank 1 failed: /shared/b/layer-00001.safetensors: cannot write (No space left on device); the part "
            "files finished so far are kept: rerun the same command to resume (with any number of ranks)"
        )
    finally:
        root.close()
        other.close()


def test_a_collective_that_loses_its_peer_is_one_line():
    """gloo ends a collective whose peer died with a RuntimeError and a traceback; the scan says it in one line."""

    def lost() -> None:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:50076. This is typically caused by")

    with pytest.raises(BundleError, match=r"^lost contact with another rank during the scan \(RuntimeError: "):
        Coordinator(RankInfo(0, 1, 0))._collective(lost)


# --------------------------------------------------------------------------- end to end under torchrun
_OTHER_WEIGHTS = textwrap.dedent(
    """
    import os, sys
    from plate_inspect.errors import ConfigError
    from plate_inspect.scanner import scan

    rank = int(os.environ["RANK"])
    try:
        scan(sys.argv[1 + rank], sys.argv[3], r=8)  # rank 1: a checkpoint of the same layout, other weights
        print(f"RANK {rank} scanned", flush=True)
    except ConfigError as e:
        print(f"RANK {rank} refused: {e}", flush=True)
    """
)


def test_ranks_given_other_weights_of_the_same_shapes_are_refused(four_layers, tmp_path):
    """One node's copy of the model is another revision with the same tensors, shapes and file sizes: the plan's
    identity agreed (names, shapes, sizes), and the job wrote a 'complete' bundle, half of it computed from the
    other weights. Now a sample of the weights' bytes is part of the plan: both ranks refuse, nothing is written."""
    other = write_llama_like(tmp_path / "other", layers=4, max_shard_bytes=150_000, seed=4)
    assert [p.stat().st_size for p in sorted(other.path.glob("*.safetensors"))] == [
        p.stat().st_size for p in sorted(four_layers.path.glob("*.safetensors"))
    ]
    script = tmp_path / "other_weights.py"
    script.write_text(_OTHER_WEIGHTS)
    out = tmp_path / "b"
    stdout = run(torchrun(str(script), str(four_layers.path), str(other.path), str(out))).stdout
    # the two ranks' lines may interleave in torchrun's merged stdout: find each rank's verdict, not lines
    refused = "refused: ranks disagree on the scan plan: weight bytes is"
    verdicts = sorted(re.findall(rf"RANK (\d) ({refused}|scanned)", stdout))
    assert verdicts == [("0", refused), ("1", refused)], stdout
    assert not (out / "manifest.json").exists() and not list(out.glob("layer-*.safetensors"))


def test_weight_sample_is_not_counted_as_read_and_same_weights_agree(four_layers, monkeypatch):
    """The sample digests the stored bytes (equal for an identical copy) and leaves bytes_read alone."""
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.scanner import plan_scan

    plan = plan_scan(str(four_layers.path), ScanSettings(r=8))
    again = plan_scan(str(four_layers.path), ScanSettings(r=8))
    assert distributed.weight_sample(plan) == distributed.weight_sample(again)
    assert plan.checkpoint.bytes_read == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert distributed.plan_identity(plan)["weight bytes"].endswith(" over 28 tensors")
    monkeypatch.delenv("WORLD_SIZE")
    assert "weight bytes" not in distributed.plan_identity(plan)  # a single process reads nothing for it


_FAILING_RANK = textwrap.dedent(
    """
    import os, sys, time
    from plate_inspect import scanner
    from plate_inspect.errors import BundleError, PlateInspectError

    rank = int(os.environ["RANK"])
    if rank == 1:
        def disk_full(*args, **kwargs):
            raise BundleError("layer-00001.safetensors: cannot write (No space left on device)")
        scanner._compute = disk_full
    try:
        scanner.scan(sys.argv[1], sys.argv[2], r=8)
        print(f"RANK {rank} scanned", flush=True)
    except PlateInspectError as e:
        print(f"RANK {rank} error: {e}", flush=True)
        if rank == 1:
            time.sleep(20)  # (a rank on another node: torchrun here would stop rank 0 as soon as this one exits)
        sys.exit(2)
    """
)


def test_a_rank_that_fails_is_named_on_rank_0_at_once(four_layers, tmp_path):
    """Rank 1 fails in its share with its own error: rank 0, done with its share, used to wait at the gather until
    rank 1's process exited and then die in gloo's traceback; now it fails at once, naming rank 1 and its error."""
    script = tmp_path / "failing_rank.py"
    script.write_text(_FAILING_RANK)
    started = time.monotonic()
    stdout = run(torchrun(str(script), str(four_layers.path), str(tmp_path / "b")), check=False).stdout
    assert time.monotonic() - started < 20  # rank 0 did not wait for rank 1's exit
    assert (
        "RANK 0 error: rank 1 failed: layer-00001.safetensors: cannot write (No space left on device); the part files "
        "finished so far are kept: rerun the same command to resume" in stdout
    ), stdout


_STOPPED_RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from plate_inspect import distributed, scanner
    from plate_inspect.errors import PlateInspectError

    distributed.timing.HEARTBEAT_SECONDS, distributed.timing.SILENCE_LIMIT_SECONDS = 0.2, 3.0
    rank = int(os.environ["RANK"])

    def stop_rank_1(event):
        if rank == 1 and event.done == 9:  # in its second part, once its first (layer 1) is on disk
            deadline = time.monotonic() + 60
            while not (Path(sys.argv[2]) / "layer-00001.safetensors").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, holding its connections, doing nothing

    try:
        scanner.scan(sys.argv[1], sys.argv[2], r=8, progress=stop_rank_1)
        print(f"RANK {rank} scanned", flush=True)
    except PlateInspectError as e:
        print(f"RANK {rank} error: {e}", flush=True)
        sys.exit(2)
    """
)


@pytest.mark.slow
def test_a_stopped_rank_fails_the_job_fast_and_the_rerun_gives_the_single_process_bundle(four_layers, tmp_path):
    """Rank 1 stops (SIGSTOP: a hung rank, or a node that vanished without closing its connections): rank 0 used
    to wait at the gather for gloo's timeout (24 h); now it names rank 1 after the silence limit and the job ends.
    Rerunning the same command resumes and gives the single-process bundle, byte for byte."""
    reference = tmp_path / "ref"
    run([EXE, "scan", str(four_layers.path), "--out", str(reference), "--r", "8", "--quiet"])
    script = tmp_path / "stopped_rank.py"
    script.write_text(_STOPPED_RANK)
    out = tmp_path / "b"
    started = time.monotonic()
    died = run(torchrun(str(script), str(four_layers.path), str(out)), check=False, timeout=150)
    assert died.returncode != 0
    assert time.monotonic() - started < 120
    silent = "RANK 0 error: rank 1 has given no sign of life for 3 s (killed, stopped, or its node is down)"
    assert silent in died.stdout, died.stdout
    with pytest.raises(BundleError, match="incomplete"):
        Bundle.load(out)
    run(torchrun("--no-python", "--", EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8", "--quiet"))
    assert_same_bundle(reference, out)


_LONELY_RANK = textwrap.dedent(
    """
    import sys
    from plate_inspect import distributed, scanner

    distributed.timing.JOIN_NOTE_SECONDS = 1.0
    scanner.scan(sys.argv[1], sys.argv[2], r=8)
    """
)


def test_a_rank_waiting_for_ranks_that_never_join_says_so(four_layers, tmp_path):
    """WORLD_SIZE=2 left in the environment (or the other rank failed before it joined): the one rank used to wait
    in init_process_group without a word (for gloo's 24 h timeout here); now it says what it waits for."""
    script = tmp_path / "lonely.py"
    script.write_text(_LONELY_RANK)
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    port = str(distributed.devices._free_port())
    env.update(ONE_THREAD, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    proc = subprocess.Popen([sys.executable, str(script), str(four_layers.path), str(tmp_path / "b")], env=env,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = ""
        timer = threading.Timer(60, proc.kill)  # without the note: nothing is ever printed
        timer.start()
        while "plate-inspect:" not in line and proc.poll() is None:
            line = proc.stderr.readline()
        timer.cancel()
    finally:
        proc.kill()
        proc.wait()
    assert line.startswith(
        f"plate-inspect: rank 0 has waited 1 s for the other ranks of WORLD_SIZE=2 to join at 127.0.0.1:{port}; a "
        "rank that failed before joining (see its output) or was never started leaves the others waiting"
    ), line


def test_rank_0_stopped_by_torchrun_says_how_to_resume(four_layers, tmp_path):
    """torchrun SIGTERMs rank 0 when rank 1 is killed: rank 0 used to die silently, leaving torchrun's report (which
    names rank 1) and no word on the finished parts; now it ends like a Ctrl-C, with the CLI's one resume line."""
    script = tmp_path / "cli_rank_1_killed.py"
    script.write_text(CLI_RANK_1_KILLED)
    died = run(torchrun("--", str(script), str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"),
               check=False)  # fmt: skip
    assert died.returncode != 0
    assert "exitcode  : -9" in died.stderr and "rank      : 1" in died.stderr  # torchrun's report: rank 1 was killed
    output = died.stdout + died.stderr
    assert output.count("interrupted: finished modules are saved; rerun the same command to resume") == 1, output


def test_require_shared_out_names_the_parts_rank_0_cannot_see(tmp_path):
    """Ranks 1 and 2 wrote their parts into their own node-local directories: rank 0 must not mark its manifest
    complete. (The check for scanner._finish; the files here are planted by hand.)"""
    (tmp_path / "layer-00000.safetensors").write_bytes(b"x")
    distributed.require_shared_out(tmp_path, [["layer-00000.safetensors"], [], []])  # everything visible: no error
    with pytest.raises(BundleError) as caught:
        distributed.require_shared_out(
            tmp_path, [["layer-00000.safetensors"], ["layer-00001.safetensors"], ["layer-00002.safetensors"]]
        )
    assert str(caught.value) == (
        f"{tmp_path}: rank 0 does not see 2 part files that ranks 1, 2 wrote there (e.g. layer-00001.safetensors): "
        "--out must be one directory that every rank shares (a shared filesystem at the same path on every node); "
        "give one and rerun the same command"
    )


_OWN_OUT = textwrap.dedent(
    """
    import os, sys
    from plate_inspect import scanner
    from plate_inspect.errors import PlateInspectError

    rank = int(os.environ["RANK"])
    out = sys.argv[2] if rank == 0 else sys.argv[3]  # node-local directories: each rank sees only its own
    try:
        scanner.scan(sys.argv[1], out, r=8)
        print(f"RANK {rank} scanned", flush=True)
    except PlateInspectError as e:
        print(f"RANK {rank} error: {e}", flush=True)
        sys.exit(2)
    """
)


def test_ranks_writing_into_directories_rank_0_cannot_see_leave_the_bundle_unfinished(four_layers, tmp_path):
    """Node-local --out dirs: rank 1's parts land where rank 0 cannot see them. The job used to exit 0 with a
    manifest marked complete and half its part files elsewhere; now rank 0 refuses to finish it, naming them."""
    script = tmp_path / "own_out.py"
    script.write_text(_OWN_OUT)
    mine, theirs = tmp_path / "node0", tmp_path / "node1"
    theirs.mkdir()
    stdout = run(torchrun(str(script), str(four_layers.path), str(mine), str(theirs)), check=False).stdout
    assert "RANK 0 error: " in stdout and "rank 0 does not see 2 part files that rank 1 wrote there" in stdout, stdout
    assert "--out must be one directory that every rank shares" in stdout
    assert sorted(p.name for p in theirs.glob("layer-*")) == ["layer-00001.safetensors", "layer-00003.safetensors"]
    with pytest.raises(BundleError, match="incomplete|unfinished"):
        Bundle.load(mine)
