"""A rank killed without a word (SIGKILL, the out-of-memory killer) under torchrun: torchrun SIGTERMs rank 0 at once,
which ends as after a Ctrl-C; its interrupted line now names the rank that had died. Interrupted ranks post an exit
mark before their line, a killed one cannot; rank 0 checks the processes of its node that left none.

Unit cases: rank 0 of two, in this process, over a real TCPStore standing for torchrun's agent store; rank 1's
process is a real one (alive, or finished and reaped). End to end: torchrun, rank 1 SIGKILLs itself mid-scan."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers_distributed import CLI_RANK_1_KILLED, agent_store_for_rank_1, run, torchrun

from plate_inspect import distributed
from plate_inspect.distributed import RankInfo, say_once
from plate_inspect.distributed.tracking import JobTrack, job_key

INTERRUPTED = "interrupted: finished modules are saved; rerun the same command to resume"
KILLED = "(rank 1 had stopped without a word: killed, e.g. by the out-of-memory killer?)"
ROOT = RankInfo(0, 2, 0, 2)


@pytest.fixture
def rank_1_announced(monkeypatch):
    """The agent store of a job of two; rank 1 has announced its process for scan 0 (this process, for now)."""
    server = agent_store_for_rank_1(monkeypatch, "killed", said_wait=5.0)
    monkeypatch.setattr(distributed.tracking, "_RUNS", {})
    track = JobTrack(RankInfo(1, 2, 1, 2), 0)
    track.announce()
    track.close()
    deadline = time.monotonic() + 10
    while not server.check([job_key("process", 0, 1)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return server


def _announce_pid(server, pid: int) -> None:
    place, _, _ = server.get(job_key("process", 0, 1)).decode().rpartition(":")
    server.set(job_key("process", 0, 1), f"{place}:{pid}")


def test_rank_0_names_a_rank_whose_process_is_gone_without_a_mark(rank_1_announced):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped, as torchrun reaps a killed worker before it SIGTERMs the others
    _announce_pid(rank_1_announced, gone.pid)
    said: list[str] = []
    started = time.monotonic()
    say_once(INTERRUPTED, said.append, KeyboardInterrupt(), ROOT)
    assert said == [f"{INTERRUPTED} {KILLED}"] and time.monotonic() - started < 3.0


def test_rank_0_names_nobody_when_the_rank_left_its_exit_mark(rank_1_announced):
    """scancel or Ctrl-C: rank 1 was interrupted too and posted its mark before its line; gone by now or not, it
    was not killed."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _announce_pid(rank_1_announced, gone.pid)
    rank_1_announced.set(job_key("left", 0, 1), "interrupted")
    said: list[str] = []
    say_once(INTERRUPTED, said.append, KeyboardInterrupt(), ROOT)
    assert said == [INTERRUPTED]


def test_rank_0_names_nobody_still_running_and_waits_for_it_at_most_the_bound(rank_1_announced, monkeypatch):
    """Rank 1 runs (this process) without a mark yet, inside a long C++ operation when the signal came: not named,
    and rank 0 says its line after EXIT_MARK_WAIT_SECONDS."""
    monkeypatch.setattr(distributed.timing, "EXIT_MARK_WAIT_SECONDS", 0.5)
    said: list[str] = []
    started = time.monotonic()
    say_once(INTERRUPTED, said.append, KeyboardInterrupt(), ROOT)
    took = time.monotonic() - started
    assert said == [INTERRUPTED] and 0.5 <= took < 5.0


def test_torchrun_job_whose_rank_1_is_killed_names_it(four_layers, tmp_path):
    script = tmp_path / "cli_rank_1_killed.py"
    script.write_text(CLI_RANK_1_KILLED)
    died = run(torchrun("--", str(script), str(four_layers.path), "--out", str(tmp_path / "b"), "--r", "8", "--quiet"),
               check=False)  # fmt: skip
    assert died.returncode != 0 and "exitcode  : -9" in died.stderr
    lines = [line for line in (died.stdout + died.stderr).splitlines() if line.startswith("interrupted")]
    assert lines == [f"{INTERRUPTED} {KILLED}"], died.stdout + died.stderr
