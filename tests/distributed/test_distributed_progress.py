"""Distributed scans: rank 0's bar counts the whole job, not rank 0's share.

Every rank posts its finished modules (and bytes) to the job's store; rank 0's progress events carry the job's
tally (``ProgressEvent.job``) and its bar shows it. End-to-end cases run real torchrun jobs (CPU, gloo) over a
small checkpoint; unit cases drive :meth:`Coordinator.job_progress` of two ranks over a real TCPStore.
"""

from __future__ import annotations

import json
import queue
import re
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
from helpers_distributed import EXE, JOB_VARS, run, torchrun
from oracles import assert_same_bundle

from plate_inspect import distributed
from plate_inspect.bundle import ScanSettings
from plate_inspect.distributed import Coordinator, RankInfo
from plate_inspect.formatting import human_bytes
from plate_inspect.progress import ProgressCounter, ProgressEvent, as_callback
from plate_inspect.scanner import plan_scan, run_scan


def planned(model) -> tuple[int, int]:
    """The oracle: how many modules the scan plans, and their bytes (read from the checkpoint, not the scan)."""
    plan = plan_scan(str(model.path), ScanSettings(r=8))
    return len(plan.targets), sum(t.nbytes for t in plan.targets)


# --------------------------------------------------------------------------- end to end
_RECORDING_SCAN = textwrap.dedent(
    """
    import json, os, sys
    from plate_inspect.bundle import ScanSettings
    from plate_inspect.scanner import plan_scan, run_scan

    model, out, events = sys.argv[1:4]
    seen = []

    def record(e):
        job = e.job and [e.job.done, e.job.total, e.job.bytes_done, e.job.bytes_total]
        seen.append([e.done, e.total, e.label, job])

    run_scan(plan_scan(model, ScanSettings(r=8)), out, progress=record)
    with open(f"{events}-{os.environ['RANK']}.json", "w") as f:
        json.dump(seen, f)
    """
)


def test_rank_0s_bar_counts_every_ranks_modules(four_layers, tmp_path):
    """A 28-module job on 2 ranks: rank 0's bar used to end at `14/14 modules` (its share, labelled so); it now ends
    at all 28 modules and all their bytes, labelled with the ranks. The bundle is the single-process one."""
    modules, nbytes = planned(four_layers)
    out = tmp_path / "b"
    job = run(torchrun("--no-python", "--", EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8"))
    bars = [line for line in job.stderr.splitlines() if line.startswith("scan")]
    assert len(bars) == 1, job.stderr  # rank 0 alone draws it (a piped console: its final state, once)
    assert re.match(rf"scan \(2 ranks\) \S+ {modules}/{modules} modules {re.escape(human_bytes(nbytes))}/", bars[0])
    assert f"computed {modules} of {modules} modules" in job.stdout  # the summary counts as before
    reference = tmp_path / "one"  # the same threads per process as every rank (one)
    run([EXE, "scan", str(four_layers.path), "--out", str(reference), "--r", "8", "--quiet"])
    assert_same_bundle(reference, out)


def test_a_resumed_job_counts_the_kept_modules_as_done(four_layers, tmp_path):
    """Part files of a finished bundle missing (7 of 28 modules): the rescan keeps 21 modules and computes 7; rank
    0's job tally still runs to all 28 (kept ones count once their weights are checked, as in a single process),
    never goes back, and rank 1's events stay its own share's (no job tally)."""
    modules, nbytes = planned(four_layers)
    out, events, script = tmp_path / "b", tmp_path / "events", tmp_path / "scan.py"
    run_scan(plan_scan(str(four_layers.path), ScanSettings(r=8)), out)
    lost = sorted(out.glob("*.safetensors"))[1]  # one layer's part file (7 modules), rank 1's or rank 0's
    lost.unlink()
    script.write_text(_RECORDING_SCAN)
    run(torchrun("--", str(script), str(four_layers.path), str(out), str(events)))
    stats = json.loads((out / "scan_stats.json").read_text())
    assert (stats["modules_scanned"], stats["modules_resumed"]) == (7, 21)
    rank0, rank1 = (json.loads((tmp_path / f"events-{r}.json").read_text()) for r in (0, 1))
    jobs = [job for *_, job in rank0]
    assert all(job is not None and job[1] == modules and job[3] == nbytes for job in jobs)
    assert jobs[-1] == [modules, modules, nbytes, nbytes]
    assert [j[0] for j in jobs] == sorted(j[0] for j in jobs) and jobs[0][0] < modules
    assert [done for done, *_ in rank0] == sorted(done for done, *_ in rank0)  # rank 0's own: as before
    assert rank0[-1][0] == rank0[-1][1] == modules // 2
    assert [e[3] for e in rank1] == [None] * len(rank1) and rank1[-1][:2] == [modules // 2, modules // 2]


# --------------------------------------------------------------------------- the tally over a real store
@pytest.fixture
def two_ranks(monkeypatch):
    """Coordinators of rank 0 and rank 1 of one job over a real TCPStore (each with its own client)."""
    monkeypatch.setattr(distributed.timing, "PROGRESS_SECONDS", 0.05)
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    port = distributed.devices._free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    groups = [
        Coordinator(RankInfo(rank, 2, rank), torch.distributed.TCPStore("127.0.0.1", port, 2, False), "t/")
        for rank in (0, 1)
    ]
    yield groups
    for group in groups:
        group.close()
    del server


def share(callback, modules: int, nbytes: int, pause: float = 0.0) -> None:
    """A share of ``modules`` modules of ``nbytes`` bytes each, reported as the scanner does."""
    counter = ProgressCounter(callback, modules, "modules", bytes_total=modules * nbytes)
    counter.start()
    for i in range(modules):
        time.sleep(pause)
        counter.step(f"m{i}", nbytes=nbytes)


def until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_rank_0_hears_the_other_ranks_modules_while_it_waits(two_ranks):
    """Rank 0 finishes its 4 modules first; rank 1's 6 (of 100 bytes) reach rank 0's events while rank 0 waits
    (events that repeat its own done), and its last event, once both ranks are through, counts all 10."""
    root, other = two_ranks
    seen: list[ProgressEvent] = []
    with root.job_progress(seen.append, 10, 1000) as progress:
        share(progress, 4, 100)
        assert seen[-1].job == ProgressEvent(4, 10, "modules", "m3", 400, 1000)
        with other.job_progress(None, 10, 1000) as posting:
            share(posting, 6, 100, pause=0.02)
        assert until(lambda: seen[-1].job.done == 10)  # from rank 0's reading thread, before it leaves
        assert seen[-1].done == 4 and seen[-1].label == "m3"  # rank 0's own event, repeated
    assert seen[-1].job == ProgressEvent(10, 10, "modules", "m3", 1000, 1000)
    assert [e.job.done for e in seen] == sorted(e.job.done for e in seen)
    assert [e.done for e in seen] == sorted(e.done for e in seen)


def test_a_rank_posts_a_few_times_and_its_last_count_exactly(two_ranks, monkeypatch):
    """1000 modules finished in a tight loop cost rank 1 two posts to the store (the first, the last), not 1000;
    after it leaves, rank 0's last event counts them all. Rank 1's own callback gets its own events unchanged."""
    monkeypatch.setattr(distributed.timing, "PROGRESS_SECONDS", 60.0)
    root, other = two_ranks
    posts = []
    post = other._store.post
    monkeypatch.setattr(other._store, "post", lambda fn: (posts.append(fn), post(fn)))
    mine: list[ProgressEvent] = []
    with other.job_progress(mine.append, 1001, 1001 * 8) as posting:
        share(posting, 1000, 8)
    assert len(posts) == 2
    assert [e.done for e in mine] == list(range(1001)) and all(e.job is None for e in mine)
    seen: list[ProgressEvent] = []
    with root.job_progress(seen.append, 1001, 1001 * 8) as progress:
        share(progress, 1, 8)
    assert seen[-1].job == ProgressEvent(1001, 1001, "modules", "m0", 1001 * 8, 1001 * 8)


def test_a_store_that_stops_answering_does_not_hold_rank_0(monkeypatch):
    """The job's store hangs (its host gone): rank 0's events go on with its own count, and leaving takes the
    bounded wait for one read, not forever."""
    monkeypatch.setattr(distributed.timing, "PROGRESS_SECONDS", 0.05)
    monkeypatch.setattr(distributed.timing, "STORE_TIMEOUT_SECONDS", 0.3)
    hang = threading.Event()

    class Hanging:
        def add(self, key, amount):
            hang.wait()

    group = Coordinator(RankInfo(0, 2, 0), Hanging(), "t/")
    seen: list[ProgressEvent] = []
    started = time.monotonic()
    try:
        with group.job_progress(seen.append, 4, 40) as progress:
            share(progress, 2, 10, pause=0.2)
    finally:
        group.close()
        hang.set()
    assert time.monotonic() - started < 5
    assert seen[-1].job == ProgressEvent(2, 4, "modules", "m1", 20, 40)


def test_old_style_callbacks_get_one_call_per_module_not_the_jobs_news():
    """The deprecated styles took one call per finished module: events that repeat ``done`` (rank 0's job news)
    do not reach them."""
    calls: list[tuple] = []
    with pytest.warns(DeprecationWarning):
        callback = as_callback(lambda done, total, name: calls.append((done, total, name)), "scan")
    job = ProgressEvent(3, 8, "modules")
    for event in (ProgressEvent(0, 2, "modules"), ProgressEvent(1, 2, "modules", "a")):
        callback(event)
    callback(ProgressEvent(1, 2, "modules", "a", job=job))
    callback(ProgressEvent(2, 2, "modules", "b", job=job))
    assert calls == [(1, 2, "a"), (2, 2, "b")]


def test_a_devices_worker_relays_modules_not_the_jobs_news(monkeypatch):
    """``--devices`` workers are ranks too: worker 0's events that repeat ``done`` (the others' news) must not reach
    the parent as modules, which counts over all workers itself (the bar would pass the total)."""
    from plate_inspect import scanner

    job = ProgressEvent(3, 4, "modules")
    events = [ProgressEvent(0, 2, "modules", "", 0, 20), ProgressEvent(1, 2, "modules", "a", 10, 20)]
    events += [ProgressEvent(1, 2, "modules", "a", 10, 20, job=job), ProgressEvent(2, 2, "modules", "b", 20, 20)]

    def fake_run_scan(plan, out, *, overwrite, device, progress):
        for event in events:
            progress(event)

    monkeypatch.setattr(scanner, "run_scan", fake_run_scan)
    messages = queue.SimpleQueue()
    distributed.devices._device_worker(None, "out", "cpu", False, messages)
    assert [messages.get_nowait() for _ in range(messages.qsize())] == [("module", ("a", 10)), ("module", ("b", 10))]
