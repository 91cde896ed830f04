"""Distributed scans: what a torchrun job prints, once per job and at once.

A Ctrl-C or a scheduler's SIGTERM reaches every rank; an error may happen on one rank only. End-to-end cases run
real torchrun jobs (CPU, gloo) over a small checkpoint, each in a session of its own that a timeout kills whole;
wrapper scripts slow a rank down or make it fail. Unit cases drive :func:`say_once` over a real TCPStore standing
for torchrun's agent store.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers_distributed import (
    SCAN_RECORDING_EXIT,
    agent_store_for_rank_1,
    run,
    said,
    scan_job,
    torchrun,
)

from plate_inspect import distributed
from plate_inspect.distributed import Fault, RankInfo, say_once
from plate_inspect.errors import BundleError

INTERRUPTED = "interrupted: finished modules are saved; rerun the same command to resume"


# --------------------------------------------------------------------------- Ctrl-C and SIGTERM
_SLOW_SHARE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from plate_inspect import scanner

    marks, rank = Path(sys.argv[1]), os.environ["RANK"]
    sys.argv[1:2] = []
    _compute = scanner._compute

    def slow_compute(todo, *args, **kwargs):  # every rank in its share: the test may interrupt the job now
        (marks / f"scanning-{rank}").write_text(str(os.getpid()))
        time.sleep(0.5)
        return _compute(todo, *args, **kwargs)

    scanner._compute = slow_compute
    """
)
_SLOW_CLI = _SLOW_SHARE + SCAN_RECORDING_EXIT


@pytest.mark.parametrize("how", ["ctrl-c", "scancel"])
def test_an_interrupted_job_says_so_once(four_layers, tmp_path, how):
    """Ctrl-C in the terminal (torchrun passes SIGINT on to every rank) or a scheduler's SIGTERM to every process of
    the job (scancel, a pod's stop): each rank used to print the interrupted line; now rank 0 alone does, and every
    rank still exits with 130."""
    with scan_job(_SLOW_CLI, four_layers.path, tmp_path) as (job, marks):
        deadline = time.monotonic() + 120
        while not all((marks / f"scanning-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            assert job.poll() is None, job.stdout.read()
            time.sleep(0.1)
        if how == "ctrl-c":
            os.kill(job.pid, signal.SIGINT)  # the terminal's foreground group is torchrun (workers have sessions)
        else:
            for pid in [job.pid, *(int((marks / f"scanning-{r}").read_text()) for r in (0, 1))]:
                os.kill(pid, signal.SIGTERM)
        output, _ = job.communicate(timeout=120)
    assert said(output) == [INTERRUPTED], output
    assert [(marks / f"exit-{r}").read_text() for r in (0, 1)] == ["130", "130"]


_BUSY_SAYING = (
    _SLOW_SHARE
    + textwrap.dedent(
        """
    from plate_inspect.distributed import reporting

    _say = reporting._say_interrupted

    def busy_say(*args, **kwargs):  # a rank on a busy node: 3 s from the interrupt to its line
        (marks / f"saying-{rank}").write_text("")
        time.sleep(3)
        return _say(*args, **kwargs)

    reporting._say_interrupted = busy_say
    """
    )
    + SCAN_RECORDING_EXIT
)


def test_torchruns_late_sigterm_after_scancels_leaves_the_line_and_exit_130(four_layers, tmp_path):
    """scancel SIGTERMs every rank and torchrun; torchrun then SIGTERMs the ranks again. On a busy node torchrun's
    came after a rank had left the scan, while it was getting to its interrupted line: both ranks died there (-15),
    and the job ended without any line (the scancel case above failed so under load: no exit marks). Here torchrun
    gets its SIGTERM once both ranks are on their way to the line, which takes them 3 s."""
    with scan_job(_BUSY_SAYING, four_layers.path, tmp_path) as (job, marks):
        deadline = time.monotonic() + 120
        while not all((marks / f"scanning-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            assert job.poll() is None, job.stdout.read()
            time.sleep(0.1)
        for r in (0, 1):
            os.kill(int((marks / f"scanning-{r}").read_text()), signal.SIGTERM)  # scancel's, to each rank
        while not all((marks / f"saying-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(job.pid, signal.SIGTERM)  # scancel's to torchrun, which passes it on to the ranks
        output, _ = job.communicate(timeout=120)
    assert said(output) == [INTERRUPTED], output
    assert [(marks / f"exit-{r}").read_text() for r in (0, 1) if (marks / f"exit-{r}").exists()] == ["130", "130"]


# --------------------------------------------------------------------------- an error on one rank only
_FAILS_IN_ITS_SHARE = textwrap.dedent(
    """
    import os, sys, time
    from plate_inspect import scanner
    from plate_inspect.errors import BundleError

    _compute, first = scanner._compute, [True]

    def compute(todo, *args, **kwargs):
        if os.environ["RANK"] == "1":
            raise BundleError("layer-00001.safetensors: cannot write (No space left on device)")
        if first[0]:  # rank 0: a slow first module, shorter than the 10 s a rank used to wait for rank 0's line
            first[0] = False
            time.sleep(8)
            print("RANK 0 SLOW STEP DONE", file=sys.stderr, flush=True)
        return _compute(todo, *args, **kwargs)

    scanner._compute = compute
    from plate_inspect.cli.main import main

    sys.argv = ["plate-inspect", "scan", *sys.argv[1:]]
    main()
    """
)


def test_an_error_in_one_ranks_share_is_said_at_once_and_once(four_layers, tmp_path):
    """Rank 1 fails in its share while rank 0 is busy with a slow module: rank 1 used to wait 10 s for rank 0's
    line before printing its own (so the line came after rank 0's slow step), and rank 0, stopped by torchrun,
    then added an interrupted line. Now rank 1's line, with how to resume, is the job's only line, and it comes
    before rank 0 is done with its step."""
    script = tmp_path / "fails.py"
    script.write_text(_FAILS_IN_ITS_SHARE)
    died = run(torchrun("--", str(script), str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"),
               check=False)  # fmt: skip
    output = died.stdout + died.stderr
    lines = [line for line in output.splitlines() if line.startswith(("error:", "interrupted", "RANK 0 SLOW"))]
    assert lines[0] == (
        "error: rank 1: layer-00001.safetensors: cannot write (No space left on device); the part files finished so "
        "far are kept: rerun the same command to resume (with any number of ranks)"
    ), output
    assert said(output) == lines[:1], output  # one line: no relay from rank 0, no interrupted line
    assert "exitcode  : 2" in died.stderr and "rank      : 1" in died.stderr


_MODEL_MISSING_ON_NODE_1 = textwrap.dedent(
    """
    import os, sys
    from plate_inspect import distributed

    distributed.timing.SAID_WAIT_SECONDS = 120.0  # the bound: a rank must not need it when rank 0 got further
    if os.environ["RANK"] == "1":
        sys.argv[1] = sys.argv[1] + "-missing-on-node-1"

    from plate_inspect.cli.main import main

    sys.argv = ["plate-inspect", "scan", *sys.argv[1:]]
    main()
    """
)


def test_a_model_missing_on_one_node_is_said_at_once_and_the_waiting_rank_ends(four_layers, tmp_path):
    """Only rank 1's node lacks the model. Rank 1 used to wait for rank 0's line for the whole bound
    (SAID_WAIT_SECONDS, 120 s here); rank 0 says in the store that it planned the scan, so rank 1 knows at once that
    the problem is its own. Rank 0, waiting to join, used to ignore torchrun's SIGTERM (it waits in C++) until
    torchrun killed it (SIGKILL, -9); now the SIGTERM ends it (-15)."""
    script = tmp_path / "missing.py"
    script.write_text(_MODEL_MISSING_ON_NODE_1)
    started = time.monotonic()
    died = run(torchrun("--", str(script), str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"),
               check=False, timeout=200)  # fmt: skip
    assert time.monotonic() - started < 100  # far from the 120 s bound rank 1 no longer waits for
    assert said(died.stdout + died.stderr) == [
        f"error: rank 1: '{four_layers.path}-missing-on-node-1' is neither an existing path nor a Hugging Face repo "
        "id (org/name)"
    ]
    report = died.stderr[died.stderr.index("Failures:") :]
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : -15" in report, report


# --------------------------------------------------------------------------- say_once over a real store
@pytest.fixture
def agent_store(monkeypatch):
    """The agent store of a two-rank job, seen from rank 1."""
    return agent_store_for_rank_1(monkeypatch, "t17", said_wait=30.0)


def timed_say_once(line: str, error: BaseException | None = None) -> tuple[list[str], float]:
    out: list[str] = []
    started = time.monotonic()
    say_once(line, out.append, error)
    return out, time.monotonic() - started


def test_a_rank_that_failed_where_rank_0_got_past_says_its_line_at_once(agent_store, monkeypatch):
    """Rank 1 failed before any mark (planning); rank 0 has entered the scan (its stage, posted by JobTrack.passed):
    rank 1 says its line with its rank without waiting for the 30 s bound. When both fail at the same point with the
    same line, it is said once, as it is."""
    root = distributed.JobTrack(RankInfo(0, 2, 0, 2))
    root.passed()  # rank 0 entered join: posted, not waited for
    root.close()
    out, took = timed_say_once("model missing")
    assert out == ["rank 1: model missing"] and took < 10
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t17-same")  # another job: both ranks fail at the same point
    both: list[str] = []
    ranks = [
        threading.Thread(target=say_once, args=("bad --out", both.append, None, RankInfo(r, 2, r, 2))) for r in (0, 1)
    ]
    started = time.monotonic()
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert both == ["bad --out"] and time.monotonic() - started < 10


def test_the_kind_of_fault_decides_who_says_it(agent_store, monkeypatch):
    """A verdict of rank 0 that every rank received: rank 1 is quiet at once. A failure of rank 1 in its share:
    said at once with its rank and how to resume; a rank naming that failure (a relay) is quiet because rank 1
    claimed it; a relay of a failure nobody claimed (a rank that went silent) is said by the first to claim it.
    Rank 0's own error in its share is said as it is, with how to resume."""
    verdict, own, relay = BundleError("ranks disagree"), BundleError("disk full"), BundleError("rank 1 failed: x")
    verdict.plate_fault = Fault("verdict", 0)
    assert timed_say_once("ranks disagree", verdict)[0] == []
    own.plate_fault = Fault("own", 1, after_agreement=True)
    # (join claims a rank's own failure before posting it)
    distributed.reporting._claim(distributed.tracking.job_key("claim", 0, 1))
    out, took = timed_say_once("disk full", own)
    assert out == [f"rank 1: disk full; {distributed.messages.RESUME}"] and took < 10
    monkeypatch.setenv("RANK", "0")
    relay.plate_fault = Fault("relay", 1)
    assert timed_say_once("rank 1 failed: x", relay)[0] == []  # rank 1 said it
    silent = BundleError("rank 2 has given no sign of life")
    silent.plate_fault = Fault("relay", 2)
    assert timed_say_once("rank 2 has given no sign of life", silent)[0] == ["rank 2 has given no sign of life"]
    monkeypatch.setenv("RANK", "1")
    assert timed_say_once("rank 2 has given no sign of life", silent)[0] == []  # rank 0 claimed it
    monkeypatch.setenv("RANK", "0")  # rank 0's own error in its share: no rank prefix, how to resume
    mine = BundleError("disk full on node 0")
    mine.plate_fault = Fault("own", 0, after_agreement=True)
    assert timed_say_once("disk full on node 0", mine)[0] == [f"disk full on node 0; {distributed.messages.RESUME}"]


def test_a_verdict_of_rank_0_is_said_on_rank_0_as_it_is(agent_store, monkeypatch):
    """Rank 0's own verdict (:meth:`Coordinator.on_root`: another job holds the --out directory's lock, two jobs
    started at once) passed on rank 0 for its own error in its share: its line got "the part files finished so far
    are kept: rerun the same command to resume", wrong while the other job runs. Now rank 0 says it as a single
    process would (the ranks that received it stay quiet: test_the_kind_of_fault_decides_who_says_it)."""
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda box, src: None)  # (rank 0's box: as is)
    locked = BundleError("/b: another scan is writing this bundle right now (the directory is locked)")

    def open_directory() -> None:
        raise locked

    monkeypatch.setenv("RANK", "0")
    group = distributed.Coordinator(RankInfo(0, 2, 0, 2))
    group.agreed = True  # (the ranks agreed on the plan before rank 0 opened the directory)
    with pytest.raises(BundleError) as raised:
        group.on_root(open_directory)
    distributed.reporting.record_fault(raised.value, group)  # (as join does)
    assert timed_say_once(str(locked), raised.value)[0] == [str(locked)]


def test_an_interruption_is_said_by_rank_0_unless_a_rank_said_why(agent_store, monkeypatch):
    """Interrupted: rank 0 says it; rank 1 is quiet once rank 0 has, and says it with its rank when rank 0 said
    nothing within the wait (rank 0 gone, or busy: then rank 0 is quiet when it gets to it, session 18). After a
    rank said its own error, nobody adds an interrupted line."""
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 1.0)
    stop = KeyboardInterrupt()
    assert timed_say_once(INTERRUPTED, stop)[0] == [f"rank 1: {INTERRUPTED}"]  # rank 0 said nothing
    # No call below waits for an absent rank: the production bound again, so that a store call slowed past 1 s by a
    # loaded machine (load 15 once made rank 0's claim time out and speak) does not pass for "nobody claimed it".
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 10.0)
    monkeypatch.setenv("RANK", "0")
    assert timed_say_once(INTERRUPTED, stop)[0] == []  # rank 1 said it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t17a")  # another job
    assert timed_say_once(INTERRUPTED, stop)[0] == [INTERRUPTED]
    monkeypatch.setenv("RANK", "1")
    assert timed_say_once(INTERRUPTED, stop)[0] == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t17b")  # another job: nothing said yet
    own = BundleError("disk full")
    own.plate_fault = Fault("own", 1, after_agreement=True)
    assert timed_say_once("disk full", own)[0] == [f"rank 1: disk full; {distributed.messages.RESUME}"]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        out, took = timed_say_once(INTERRUPTED, stop)
        assert out == [] and took < 0.5, rank


def test_a_rank_whose_rank_0_stopped_beating_does_not_wait_for_the_bound(agent_store, monkeypatch):
    """torchrun stops rank 1 after rank 0 was killed mid-scan: rank 0 will never say its line. Its heartbeat in the
    agent store has stopped, so rank 1 says the interrupted line with its rank after 2.5 beats, not the 30 s bound;
    a rank 0 that still beats is waited for."""
    monkeypatch.setattr(distributed.timing, "HEARTBEAT_SECONDS", 0.2)
    agent_store.set(distributed.tracking.job_key("beat", 0, 0), "7")  # rank 0's last beat
    out, took = timed_say_once(INTERRUPTED, KeyboardInterrupt())
    assert out == [f"rank 1: {INTERRUPTED}"] and 0.5 <= took < 10
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 2.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t17c")  # another job (rank 1 said the line of the first)
    beating = threading.Event()

    def beat() -> None:
        n = 7
        while not beating.wait(0.1):
            n += 1
            agent_store.set(distributed.tracking.job_key("beat", 0, 0), str(n))

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        out, took = timed_say_once(INTERRUPTED, KeyboardInterrupt())
    finally:
        beating.set()
        thread.join()
    assert out == [f"rank 1: {INTERRUPTED}"] and took >= 2.0  # waited for the bound: rank 0 was alive


_SAYS_WHILE_SIGTERMED = textwrap.dedent(
    """
    import os, signal, sys, threading
    from datetime import timedelta
    import torch
    from plate_inspect import distributed
    from plate_inspect.distributed import say_once

    port = distributed.devices._free_port()  # the agent store, with rank 1's environment
    server = torch.distributed.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    os.environ.update(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="late", TORCHELASTIC_RESTART_COUNT="0")
    distributed.timing.SAID_WAIT_SECONDS, distributed.timing.QUIET_EXIT_SECONDS = 3.0, 0.0
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # torchrun's, while rank 1 waits
    say_once(sys.argv[1], print, KeyboardInterrupt())
    print("exit", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """
)


def test_a_late_sigterm_while_a_rank_says_its_line_does_not_end_it(tmp_path):
    """scancel SIGTERMs every rank, and torchrun, stopped by its own SIGTERM, sends each rank another. On a busy
    node torchrun's came seconds after the first had ended the scan, when the CLI's handler was gone: rank 1,
    waiting for rank 0's interrupted line, died at the signal's default action (exit -15: the flake of the scancel
    case above under load), as did a rank 0 that had not printed it yet. Now a rank saying its line ignores it: rank
    1 says the line when rank 0 said nothing within the wait, and SIGTERM's default action is back after."""
    script = tmp_path / "late_sigterm.py"
    script.write_text(_SAYS_WHILE_SIGTERMED)
    done = run([sys.executable, str(script), INTERRUPTED], check=False, timeout=120)
    assert (done.returncode, done.stdout.splitlines()) == (0, [f"rank 1: {INTERRUPTED}", "exit True"]), done.stderr


def test_a_second_sigterm_while_rank_0_unwinds_a_python_callers_scan_raises_nothing(monkeypatch):
    """Rank 0 of a torchrun job scanning from Python (no CLI handler): SIGTERM raises KeyboardInterrupt, so that the
    scan ends as after a Ctrl-C. scancel's SIGTERM and torchrun's both reach it: the second raised again while the
    first unwound (finishing the part being written, telling the other ranks), wherever it landed. Now the first
    alone raises; SIGTERM's default action is back after."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t21")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with distributed.signals.sigterm_interrupts(RankInfo(0, 2, 0, 2)):
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        try:
            signal.raise_signal(signal.SIGTERM)  # torchrun's, while the first unwinds
        except KeyboardInterrupt:
            pytest.fail("the second SIGTERM raised KeyboardInterrupt again")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
