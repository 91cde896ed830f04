"""Distributed scans: ranks of one node that fail with different lines each say theirs before any of them exits.

Under torchrun the first rank of a node to exit gets the node's other ranks stopped (torchrun's SIGTERM), so a
rank that said its line and exited at once could silence another rank of its node that was still saying a different
line. The ranks run here as threads of this process over a real TCPStore standing for torchrun's agent store; a
thread returning from :func:`say_once` stands for its process exiting.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers_distributed import agent_store_for_rank_1

from plate_inspect import distributed
from plate_inspect.distributed import RankInfo, say_once

MISSING = "'/models/m' is neither an existing path nor a Hugging Face repo id (org/name)"
FULL = "/scratch/b: cannot write the bundle: no space left on device"


@pytest.fixture
def agent_store(monkeypatch):
    return agent_store_for_rank_1(monkeypatch, "node-lines", said_wait=5.0)


def run_ranks(lines: dict[int, str], slow: dict[int, float], local_world_size: int) -> list[tuple[str, int]]:
    """Ranks of one node fail before joining, rank ``r`` with ``lines[r]``; saying a line takes ``slow[r]`` s on
    rank ``r`` (a loaded machine, a slow terminal). The events in order: ("said", rank) and ("exit", rank)."""
    infos = {r: RankInfo(r, local_world_size, r, local_world_size, 0, 1) for r in range(local_world_size)}
    for rank, info in infos.items():  # the others get past the first point (they join)
        if rank not in lines:
            track = distributed.JobTrack(info)
            track.passed()
            track.close()
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def rank_process(rank: int) -> None:
        def say(line: str) -> None:
            time.sleep(slow.get(rank, 0.0))
            with lock:
                events.append(("said", rank))

        say_once(lines[rank], say, None, infos[rank])
        with lock:
            events.append(("exit", rank))

    threads = [threading.Thread(target=rank_process, args=(rank,)) for rank in lines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return events


def test_a_second_line_on_the_node_is_said_before_the_first_rank_exits(agent_store):
    """Rank 0 and rank 1 of one node fail with different lines; rank 1 is slow to say its own. Rank 0 used to exit
    right after its line, which under torchrun stops rank 1 before it printed: its problem was never said."""
    events = run_ranks({0: MISSING, 1: FULL}, slow={1: 1.0}, local_world_size=2)
    first_exit = next(i for i, (what, _) in enumerate(events) if what == "exit")
    assert sorted(rank for what, rank in events[:first_exit] if what == "said") == [0, 1], events


def test_ranks_that_share_a_line_and_one_with_its_own_are_all_said_before_any_exits(agent_store):
    """Three ranks of one node share a line (one of them says it, slowly) and a fourth has its own, said at once:
    the fourth used to exit before the shared line was said. Each line is still said once."""
    slow = {0: 1.0, 1: 1.0, 2: 1.0}
    events = run_ranks({0: MISSING, 1: MISSING, 2: MISSING, 3: FULL}, slow=slow, local_world_size=4)
    first_exit = next(i for i, (what, _) in enumerate(events) if what == "exit")
    said = [rank for what, rank in events if what == "said"]
    assert len(said) == 2 and 3 in said, events  # one line for ranks 0-2, one for rank 3
    assert len([e for e in events[:first_exit] if e[0] == "said"]) == 2, events


class _RacingStore:
    """A dict standing for the agent store, in which the job's last rank counts its line and its fall right after
    the first read of the line's count: the interleaving that, seen from a thread on a busy machine, once made a
    problem of every rank read as node 0's (a CI run: `ranks 0-1 on node 0 (vm): ...` beside the job's line)."""

    def __init__(self, values: dict[str, int], same: str, late: list[str]):
        self.values, self.same, self.late = dict(values), same, late

    def add(self, key: str, amount: int) -> int:
        value = self.values.get(key, 0) + amount
        self.values[key] = value
        if key == self.same and amount == 0 and self.late:
            for other in self.late:  # the last rank: its line, then its fall (say_once's order)
                self.values[other] = self.values.get(other, 0) + 1
            self.late = []
        return value


def test_a_line_every_rank_had_is_the_jobs_even_when_the_last_rank_counts_in_between():
    """Every rank of a 2 x 2 job fails before joining with one line. Node 0's speaker reads the tallies while
    rank 3 (node 1) is counting itself: the answer must still be "every rank had it" (the job's line, said once as
    it is), not node 0's own problem."""
    from plate_inspect.distributed import reporting
    from plate_inspect.distributed.tracking import job_key

    digest, scan, stage = "d", 7, 0

    def key(what: str, *parts: object) -> str:
        return job_key(what, scan, *parts)

    node0, node1 = ("node", 0), ("node", 1)
    values = {
        key("same", digest): 3,
        key("fell", stage): 3,
        key("fell", stage, *node0): 2,
        key("fell", stage, *node1): 1,
    }
    last_rank = [key("same", digest), key("fell", stage), key("fell", stage, *node1)]
    store = _RacingStore(values, key("same", digest), last_rank)
    info = RankInfo(0, 4, 0, 2, 0, 2)
    assert reporting._wait_for_the_ranks(store, key, info, stage, digest) is True
