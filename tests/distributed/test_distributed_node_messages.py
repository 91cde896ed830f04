"""Distributed scans: a problem of some ranks is said once per node, naming them; a scan's stage is its own.

Unit cases run the ranks of a job as threads of this process, each with its own :class:`RankInfo`, over a real
TCPStore standing for torchrun's agent store. End-to-end cases run real torchrun jobs (CPU, gloo): two agents with
c10d rendezvous on this machine stand for two nodes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers_distributed import (
    JOB_VARS,
    ONE_THREAD,
    SCAN_RECORDING_EXIT,
    agent_store_for_rank_1,
    said,
    scan_job,
)

from plate_inspect import distributed
from plate_inspect.distributed import RankInfo, say_once

HOST = socket.gethostname()
LINE = "'/models/m' is neither an existing path nor a Hugging Face repo id (org/name)"
INTERRUPTED = "interrupted: finished modules are saved; rerun the same command to resume"


@pytest.fixture
def agent_store(monkeypatch):
    """The agent store of a job (torchrun's agent holds it); the environment is rank 1's of two."""
    return agent_store_for_rank_1(monkeypatch, "t18", said_wait=30.0)


def job(nodes: list[int], failing: set[int], line: str = LINE) -> tuple[list[str], float]:
    """A job of ``len(nodes)`` nodes with ``nodes[i]`` ranks each (numbered node by node, as torchrun does): the
    ``failing`` ranks fail before joining with ``line`` and say it (say_once, each on a thread), the others join
    (their first point, JobTrack.passed). The lines said, and how long the slowest rank took."""
    world, first, infos = sum(nodes), 0, []
    for node, count in enumerate(nodes):
        infos += [RankInfo(first + i, world, i, count, node, len(nodes)) for i in range(count)]
        first += count
    said: list[str] = []
    for info in infos:
        if info.rank not in failing:
            track = distributed.JobTrack(info)
            track.passed()
            track.close()
    started = time.monotonic()
    ranks = [
        threading.Thread(target=say_once, args=(line, said.append, None, info))
        for info in infos
        if info.rank in failing
    ]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    return said, time.monotonic() - started


@pytest.mark.parametrize(
    ("nodes", "failing", "expected"),
    [
        # rank 0's node lacks the model: said for that node, not as the whole job's problem (item 1)
        ([2, 2], {0, 1}, [f"ranks 0-1 on node 0 ({HOST}): {LINE}"]),
        ([1, 1], {0}, [f"rank 0 on node 0 ({HOST}): {LINE}"]),
        # 8 ranks of one node: one line naming them, not 8 (item 2)
        ([8, 8], set(range(8, 16)), [f"ranks 8-15 on node 1 ({HOST}): {LINE}"]),
        # some ranks on each of two nodes: one line per node
        ([3, 3], {1, 2, 3, 4, 5}, [f"ranks 1-2 on node 0 ({HOST}): {LINE}", f"ranks 3-5 on node 1 ({HOST}): {LINE}"]),
        # every rank: the job's problem, said once as it is
        ([2, 2], {0, 1, 2, 3}, [LINE]),
        # one node: the ranks, no node
        ([4], {1, 3}, [f"ranks 1, 3: {LINE}"]),
    ],
    ids=["rank-0s-node", "rank-0-alone", "8-ranks-of-node-1", "some-of-each-node", "every-rank", "one-node"],
)
def test_a_problem_of_some_ranks_is_said_once_per_node_naming_them(agent_store, nodes, failing, expected):
    """Session 17 said a problem of rank 0's node without any prefix (as if every rank had it), and each rank of
    another node with its own ``rank N:`` line (8 lines for 8 ranks). Now the ranks of a node that share a line say
    it once, naming them and the node, as soon as every rank of the node failed or got past that point (here at
    once: far from the 30 s bound); a line every rank shares is said once, as it is."""
    said, took = job(nodes, failing)
    assert sorted(said) == expected
    assert took < 10


def test_two_scans_in_one_process_do_not_share_a_stage(agent_store, monkeypatch, tmp_path):
    """A scan this process ran before (here a single-process one) used to leave the process-wide stage counter
    at 1, so rank 1, failing before the next job's scan, took rank 0's stage 1 (rank 0 entered that job's scan)
    for "not past my point" and waited the whole bound (30 s) for a line rank 0 never says. Each scan's stage is
    now its own (JobTrack): rank 1 sees at once that rank 0 got past where it failed."""
    job_env = {var: os.environ[var] for var in os.environ if var in JOB_VARS or var.startswith("TORCHELASTIC_")}
    for var in job_env:
        monkeypatch.delenv(var)
    with distributed.join():  # the earlier scan: one process, no torchrun
        pass
    for var, value in job_env.items():
        monkeypatch.setenv(var, value)
    keys = agent_store.num_keys()
    root_env = {**{k: v for k, v in os.environ.items() if k not in JOB_VARS}, **job_env, **ONE_THREAD}
    root_env.update(RANK="0", LOCAL_RANK="0")
    root = subprocess.Popen(  # rank 0 of the next job: enters the scan, then waits for rank 1 to join
        [sys.executable, "-c", "from plate_inspect import distributed\ndistributed.join().__enter__()"],
        env=root_env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while agent_store.num_keys() == keys and time.monotonic() < deadline:  # rank 0 posted its point
            assert root.poll() is None
            time.sleep(0.05)
        said: list[str] = []
        started = time.monotonic()
        say_once("model missing", said.append)  # rank 1 fails before joining
        took = time.monotonic() - started
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
    assert said == ["rank 1: model missing"] and took < 10


def test_a_rank_0_that_gets_to_the_interrupted_line_late_is_quiet(agent_store, monkeypatch):
    """Rank 0 was inside one long C++ operation when the Ctrl-C came (it still beats): rank 1 waited for its line
    for the bound, then said it itself; rank 0, getting to it after that, used to add its own (2 lines)."""
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 0.5)
    said: list[str] = []
    say_once(INTERRUPTED, said.append, KeyboardInterrupt())
    # Rank 0 waits for nobody: the production bound, so that a store call slowed past 0.5 s by a loaded machine does
    # not pass for "nobody claimed the line" (as a 1 s bound once did at load 15)
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 10.0)
    say_once(INTERRUPTED, said.append, KeyboardInterrupt(), RankInfo(0, 2, 0, 2))
    assert said == [f"rank 1: {INTERRUPTED}"]


def test_a_second_interrupt_after_a_scan_ended_by_one_belongs_to_that_scan(agent_store, monkeypatch):
    """scancel gives each rank SIGTERM twice (its own and torchrun's): the second KeyboardInterrupt may come after
    the first has left the scan, without a Fault. Counted as the next scan's, whose keys are empty, it made rank 1
    wait for a line rank 0 had said in the scan that ended, then say its own (2 lines; 1 run of 5 of the scancel
    test). It belongs to the scan that ended with the first: rank 1 hears rank 0's line there at once."""
    monkeypatch.setattr(distributed.tracking, "_RUNS", {})
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 5.0)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # (a group that exists: no joining)
    monkeypatch.setattr(distributed.group, "_job_store", lambda: None)
    with pytest.raises(KeyboardInterrupt), distributed.join() as group:
        scan = group.track.scan
        raise KeyboardInterrupt
    first = KeyboardInterrupt()
    first.plate_fault = distributed.Fault("interrupted", 0, scan=scan)
    said: list[str] = []
    say_once(INTERRUPTED, said.append, first, RankInfo(0, 2, 0, 2))  # rank 0 says it, in the scan that ended
    started = time.monotonic()
    say_once(INTERRUPTED, said.append, KeyboardInterrupt())  # rank 1's second interrupt, outside the scan
    assert said == [INTERRUPTED] and time.monotonic() - started < 2


# --------------------------------------------------------------------------- end to end: two "nodes"
_MISSING_ON_ONE_NODE = textwrap.dedent(
    """
    import os, sys

    node, sys.argv[1:2] = sys.argv[1], []
    if os.environ["GROUP_RANK"] == node:  # this node lacks the model
        sys.argv[1] = sys.argv[1] + f"-missing-on-node-{node}"
    from plate_inspect.cli.main import main

    sys.argv = ["plate-inspect", "scan", *sys.argv[1:]]
    main()
    """
)


@pytest.mark.parametrize("node", [0, 1])
def test_a_model_missing_on_one_node_is_said_once_for_that_node_and_the_job_ends(four_layers, tmp_path, node):
    """Two torchrun agents (nodes) of two ranks each; the model is missing on one node. Session 17: on rank 0's
    node, rank 0's line without a prefix, as if the whole job lacked the model, and each rank of the other node a C++
    traceback when the first node's store went away; on the other node, its line, while rank 0's node waited to
    join for up to 24 h (a note every minute). Now one line naming the node's ranks, and the job ends: the other
    node's ranks, waiting to join, end once a rank said a line (as torchrun's SIGTERM ends them on one node)."""
    script = tmp_path / "missing.py"
    script.write_text(_MISSING_ON_ONE_NODE)
    endpoint = f"localhost:{distributed.devices._free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "r18", "--", str(script), str(node),
           str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k not in JOB_VARS}, **ONE_THREAD}
    started = time.monotonic()
    agents = [
        subprocess.Popen(
            cmd, env=env, text=True, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        output = "".join(agent.communicate(timeout=150)[0] for agent in agents)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.communicate()
    took = time.monotonic() - started
    lines = [line for line in output.splitlines() if line.startswith(("error:", "rank ", "interrupted", "plate-"))]
    ranks = "0-1" if node == 0 else "2-3"
    assert lines[0] == (
        f"error: ranks {ranks} on node {node} ({HOST}): '{four_layers.path}-missing-on-node-{node}' is neither an "
        "existing path nor a Hugging Face repo id (org/name)"
    ), output
    # the other node's ranks end once the line is said; if the first node's store went first: one line for them
    assert all(line.startswith(f"error: ranks 2-3 on node 1 ({HOST}): lost contact with") for line in lines[1:])
    assert len(lines) == 1 or (node == 0 and len(lines) == 2), output
    assert "/plate_inspect/" not in output and "/cli/" not in output, output  # no traceback through plate-inspect
    assert took < 60  # (the waiting node ended well before its first note, at 60 s)


_BUSY_RANK_0 = (
    textwrap.dedent(
        """
    import os, signal, sys, time
    from pathlib import Path
    from plate_inspect import distributed, scanner

    distributed.timing.SAID_WAIT_SECONDS = 2.0
    marks, rank = Path(sys.argv[1]), os.environ["RANK"]
    sys.argv[1:2] = []
    _compute, first = scanner._compute, [True]

    def compute(todo, *args, **kwargs):
        (marks / f"scanning-{rank}").write_text("1")
        if rank == "0" and first[0]:  # one long C++ operation: no Python signal handler runs in the main thread
            first[0] = False
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            (marks / "busy").write_text("1")
            time.sleep(5)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        else:
            time.sleep(0.5)
        return _compute(todo, *args, **kwargs)

    scanner._compute = compute
    """
    )
    + SCAN_RECORDING_EXIT
)


def test_a_ctrl_c_while_rank_0_is_inside_a_long_operation_is_said_once(four_layers, tmp_path):
    """Ctrl-C while rank 0 is inside one C++ operation longer than the wait for its line (simulated: its main thread
    blocks the signals for 5 s; the wait is 2 s here, 10 s by default): rank 1 says the interrupted line when the
    wait is over, as before, and rank 0, whose handler runs only when the operation returns, used to add its own
    (2 lines). Now it sees that rank 1 said it: one line, at the same time as before."""
    with scan_job(_BUSY_RANK_0, four_layers.path, tmp_path) as (job, marks):
        deadline = time.monotonic() + 120
        while not ((marks / "busy").exists() and (marks / "scanning-1").exists()) and time.monotonic() < deadline:
            assert job.poll() is None, job.stdout.read()
            time.sleep(0.05)
        os.kill(job.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches torchrun, which passes it on
        output, _ = job.communicate(timeout=120)
    assert said(output) == [f"rank 1: {INTERRUPTED}"], output
    assert [(marks / f"exit-{r}").read_text() for r in (0, 1)] == ["130", "130"]
