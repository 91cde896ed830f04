"""Distributed scans: one error line per problem under torchrun, and ranks whose store host vanished.

End-to-end cases run real torchrun jobs (or two ranks started by hand, rank 0 holding the store) on CPU (gloo) over
a small checkpoint, each in a session of its own that a timeout kills whole; unit cases use a real TCPStore.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
from helpers_distributed import (
    EXE,
    JOB_VARS,
    ONE_THREAD,
    agent_store_for_rank_1,
    run,
    torchrun,
)
from oracles import assert_same_bundle

from plate_inspect import distributed
from plate_inspect.bundle import Bundle
from plate_inspect.distributed import BoundedStore, Coordinator, RankInfo, StoreTimeout, say_once
from plate_inspect.errors import BundleError


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- one line per problem
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tau", "1.5"], "error: tau must lie strictly between 0 and 1, got 1.5"),  # a setting out of range
        (["--r", "abc"], "error: Invalid value for '--r': 'abc' is not a valid integer."),  # click's own check
        (["--out", "MODEL/config.json"], "error: MODEL/config.json: cannot write the bundle: it is a file"),
    ],
)
def test_an_error_every_rank_reaches_is_printed_once(four_layers, tmp_path, args, expected):
    """Both ranks fail the same way: the job used to print the line twice (once per rank); now rank 0 alone does,
    and each rank still exits with the CLI's code 2."""
    model = str(four_layers.path)
    args = [a.replace("MODEL", model) for a in args]
    out = ["--out", str(tmp_path / "b")] if "--out" not in args else []
    died = run(torchrun("--no-python", "--", EXE, "scan", model, "--r", "8", "--quiet", *out, *args), check=False)
    assert died.returncode != 0
    lines = error_lines(died.stdout + died.stderr)
    assert len(lines) == 1 and lines[0].startswith(expected.replace("MODEL", model)), lines
    assert "Traceback" not in died.stdout  # (torchrun's own report is on stderr)
    assert "exitcode  : 2" in died.stderr  # torchrun's report: a rank ended with the CLI's exit code 2


_CLI_OWN_MODEL = textwrap.dedent(
    """
    import os, sys
    from plate_inspect import distributed

    distributed.timing.SAID_WAIT_SECONDS = 2.0
    if os.environ["RANK"] == "1":  # this rank's node lacks the model (another path here, for the test)
        sys.argv[1] = sys.argv[1] + "-missing-on-node-1"

    from plate_inspect.cli.main import main

    sys.argv = ["plate-inspect", "scan", *sys.argv[1:]]
    main()
    """
)


def test_an_error_of_one_rank_alone_is_printed_with_its_rank(four_layers, tmp_path):
    """Only rank 1's node lacks the model: rank 1 says so, naming itself; rank 0 (fine, waiting to join) prints no
    error line of its own."""
    script = tmp_path / "own_model.py"
    script.write_text(_CLI_OWN_MODEL)
    died = run(torchrun("--", str(script), str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"),
               check=False)  # fmt: skip
    assert died.returncode != 0
    lines = error_lines(died.stdout + died.stderr)
    assert lines == [
        f"error: rank 1: '{four_layers.path}-missing-on-node-1' is neither an existing path nor a Hugging Face repo "
        "id (org/name)"
    ], lines


@pytest.fixture
def agent_store(monkeypatch):
    """The agent store of a two-rank job, seen from rank 1."""
    return agent_store_for_rank_1(monkeypatch, "t16", said_wait=0.5)


def test_say_once_compares_with_what_the_other_ranks_said(agent_store, monkeypatch):
    """Both ranks failing with the same line: it is said once, as it is (session 18: whichever rank claims it
    first). Rank 1 alone, rank 0 silent: rank 1 says it with its rank once the wait is over; rank 1 alone, rank 0
    past the point where it failed: at once."""
    said: list[str] = []
    ranks = [
        threading.Thread(target=say_once, args=("no model", said.append, None, RankInfo(r, 2, r, 2))) for r in (0, 1)
    ]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert said == ["no model"]
    said.clear()
    say_once("its own problem", said.append)  # nothing from rank 0: rank 1 waits, then speaks for itself
    assert said == ["rank 1: its own problem"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t16b")  # another job, where rank 0 got past the point
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 30.0)
    root = distributed.JobTrack(RankInfo(0, 2, 0, 2))
    root.passed()
    root.close()
    started = time.monotonic()
    say_once("its own problem", said.append)
    assert said == ["rank 1: its own problem"] * 2 and time.monotonic() - started < 10
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", 30.0)
    monkeypatch.setattr(distributed.store, "_LOST_STORES", {f"127.0.0.1:{os.environ['MASTER_PORT']}"})
    started = time.monotonic()
    say_once("no model", said.append)  # a store this rank found gone (its host vanished) is not waited on again
    assert said[-1] == "rank 1: no model" and time.monotonic() - started < 5
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # no agent store (ranks started by hand)
    said.clear()
    say_once("no model", said.append)
    assert said == ["rank 1: no model"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    say_once("alone", said.append)
    assert said[-1] == "alone"


# --------------------------------------------------------------------------- a store host that vanished
def test_a_store_call_that_never_returns_is_bounded(monkeypatch):
    """A store whose server stopped answering blocks the caller forever (TCPStore's own timeout does not cover a
    reply that never comes); BoundedStore gives up after STORE_TIMEOUT_SECONDS, and at once after that."""
    monkeypatch.setattr(distributed.timing, "STORE_TIMEOUT_SECONDS", 0.3)
    never = threading.Event()

    class Stuck:
        def add(self, key: str, amount: int) -> int:
            never.wait()
            return 0

    store = BoundedStore(Stuck())
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match="no answer for 0 s"):
        store.add("k", 1)
    assert 0.3 <= time.monotonic() - started < 3
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.add("k", 1)
    assert time.monotonic() - started < 0.1
    never.set()


_STORE_SERVER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch

    server = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timedelta(seconds=30),
                                        wait_for_workers=False)
    print("up", flush=True)
    time.sleep(600)
    """
)


def test_a_rank_waiting_on_a_stopped_store_host_names_it_within_the_bound(tmp_path, monkeypatch):
    """The store's host stops answering (SIGSTOP: the process keeps its sockets open, as a powered-off or cut-off
    host does): a rank waiting for the others in the store used to wait forever; now it fails within the bound,
    naming the store's address and how to go on."""
    monkeypatch.setattr(distributed.timing, "STORE_TIMEOUT_SECONDS", 2.0)
    monkeypatch.setattr(distributed.timing, "HEARTBEAT_SECONDS", 0.2)
    port = distributed.devices._free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    script = tmp_path / "server.py"
    script.write_text(_STORE_SERVER)
    server = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    coordinator = None
    try:
        assert server.stdout.readline().strip() == "up"
        client = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
        coordinator = Coordinator(RankInfo(1, 2, 1), client, "t/")
        os.kill(server.pid, signal.SIGSTOP)
        caught: list[BaseException] = []

        def wait_for_rank_0() -> None:
            try:
                coordinator._arrive()
            except BaseException as e:
                caught.append(e)

        waiting = threading.Thread(target=wait_for_rank_0, daemon=True)
        started = time.monotonic()
        waiting.start()
        waiting.join(30)
        assert not waiting.is_alive(), "still waiting on the stopped store after 30 s"
        assert 2.0 <= time.monotonic() - started < 10
        assert len(caught) == 1 and isinstance(caught[0], BundleError)
        assert str(caught[0]) == (
            f"lost contact with the job's store at 127.0.0.1:{port}: it has not answered for 2 s; the first node "
            "(torchrun's agent or rank 0 there) is down, stopped or unreachable: stop the job; the part files "
            "finished so far are kept: rerun the same command to resume (with any number of ranks)"
        )
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        if coordinator is not None:
            coordinator.close()


_STORE_HOST_STOPS = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from plate_inspect import distributed, scanner
    from plate_inspect.errors import PlateInspectError

    distributed.timing.HEARTBEAT_SECONDS, distributed.timing.STORE_TIMEOUT_SECONDS = 0.2, 3.0
    rank = int(os.environ["RANK"])
    _compute = scanner._compute

    def slow_compute(*args, **kwargs):  # rank 1 is still scanning its share when rank 0's host vanishes
        time.sleep(0.3)
        yield from _compute(*args, **kwargs)

    scanner._compute = slow_compute

    def stop_rank_0(event):
        if rank == 0 and event.done == 9:  # in its second part, once its first (layer 0) is on disk
            deadline = time.monotonic() + 60
            while not (Path(sys.argv[2]) / "layer-00000.safetensors").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            print("RANK 0 stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)  # its host vanished: the store it holds answers no more

    try:
        scanner.scan(sys.argv[1], sys.argv[2], r=8, progress=stop_rank_0)
        print(f"RANK {rank} scanned", flush=True)
    except PlateInspectError as e:
        print(f"RANK {rank} error: {e}", flush=True)
        sys.exit(2)
    """
)


@pytest.mark.slow
def test_a_rank_whose_store_host_vanished_stops_by_itself_and_the_rerun_gives_the_single_process_bundle(
    four_layers, tmp_path
):
    """Two ranks started by hand (rank 0 holds the job's store, as on a first node), rank 0 SIGSTOPped mid-scan:
    rank 1 used to scan its share and then wait in the store forever; now it stops within the store's bound with
    one line naming the store's address, and rerunning the same command resumes to the single-process bundle."""
    reference = tmp_path / "ref"
    run([EXE, "scan", str(four_layers.path), "--out", str(reference), "--r", "8", "--quiet"])
    script = tmp_path / "store_host_stops.py"
    script.write_text(_STORE_HOST_STOPS)
    out = tmp_path / "b"
    port = distributed.devices._free_port()
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(ONE_THREAD, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(four_layers.path), str(out)], env={**env, "RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        while "RANK 0 stopping" not in ranks[0].stdout.readline():
            assert ranks[0].poll() is None, "rank 0 ended before it stopped"
        stopped = time.monotonic()
        output = ranks[1].communicate(timeout=90)[0]
        ended = time.monotonic() - stopped
    finally:
        for proc in ranks:
            with contextlib.suppress(ProcessLookupError):  # (a rank that ended and was reaped: its group is gone)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert ranks[1].returncode == 2, output
    lost = f"RANK 1 error: lost contact with the job's store at 127.0.0.1:{port}: it has not answered for 3 s;"
    assert lost in output
    assert "rerun the same command to resume" in output and "Traceback" not in output
    assert ended < 30  # the store's bound (3 s) plus a module and the exit, not rank 1's whole share or forever
    with pytest.raises(BundleError, match="incomplete|unfinished"):
        Bundle.load(out)
    resumed = run([EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8", "--quiet"])
    assert re.search(r"resumed an interrupted scan: kept [1-9]\d* finished modules", resumed.stdout), resumed.stdout
    assert_same_bundle(reference, out)
