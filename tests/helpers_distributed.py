"""Running distributed scans in tests (distributed/): the plate-inspect console script, torchrun with two ranks on
one node, a subprocess that cannot outlive its test, and the store and environment torchrun gives rank 1."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch

from plate_inspect import distributed

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
EXE = shutil.which("plate-inspect", path=str(Path(sys.executable).parent))
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(cmd: list[str], check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own: on a timeout the whole process group goes (torchrun's workers too, a
    SIGSTOPped one included), not only torchrun, so a failing test leaves no orphan behind."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(cmd, env={**env, **ONE_THREAD}, text=True, start_new_session=True, **pipes) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {o for action in get_args_parser()._actions for o in action.option_strings}


def torchrun(*args: str) -> list[str]:
    """torchrun with two ranks on this node (``--standalone``), then ``args``."""
    # a stopped rank ignores torchrun's SIGTERM: SIGKILL it after 2 s instead of torchrun's default 30 s (torchrun
    # 2.5, the floor, has no --shutdown-timeout: it waits the 30 s)
    grace = ["--shutdown-timeout", "2"] if "--shutdown-timeout" in _torchrun_options() else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *grace, *args]


def agent_store_for_rank_1(monkeypatch, run_id: str, said_wait: float):
    """A TCPStore server, as torchrun's agent holds it, and the environment torchrun gives rank 1 of two (on one
    node); say_once waits ``said_wait`` seconds for the line to be said."""
    port = distributed.devices._free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(distributed.timing, "QUIET_EXIT_SECONDS", 0.0)
    monkeypatch.setattr(distributed.timing, "SAID_WAIT_SECONDS", said_wait)
    return server


#: The end of a rank's script (after ``marks, rank = Path(sys.argv[1]), os.environ["RANK"]``; ``sys.argv[1:]``: scan's
#: arguments): ``plate-inspect scan`` in this process, its exit code written to ``marks/exit-<rank>``.
SCAN_RECORDING_EXIT = """
from plate_inspect.cli.main import main

sys.argv = ["plate-inspect", "scan", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    (marks / f"exit-{rank}").write_text(str(e.code))
    raise
"""


@contextlib.contextmanager
def scan_job(script: str, model: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``script`` (a rank's script ending in SCAN_RECORDING_EXIT) run by torchrun on two ranks, scanning ``model``
    into ``tmp_path/b`` at r = 8: the job (a session of its own, stdout and stderr merged) and the directory the
    ranks write their marks into. A job still running at the end is killed, its whole process group."""
    path, marks = tmp_path / "rank_script.py", tmp_path / "marks"
    path.write_text(script)
    marks.mkdir()
    # torchrun's usual 30 s grace before it SIGKILLs a rank (the helper's 2 s is short for a loaded machine)
    cmd = torchrun("--shutdown-timeout", "30", "--", str(path), str(marks), str(model), "--out",
                   str(tmp_path / "b"), "--r", "8", "--quiet")  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k not in JOB_VARS}, **ONE_THREAD}
    job = subprocess.Popen(cmd, env=env, text=True, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)  # fmt: skip
    try:
        yield job, marks
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


def said(text: str) -> list[str]:
    """The lines a user reads as the job's own (errors and interruptions), not torchrun's report."""
    return [line for line in text.splitlines() if line.startswith(("error:", "interrupted", "rank "))]


#: A CLI scan under torchrun whose rank 1 SIGKILLs itself at the first module of its second part file (as the OOM
#: killer would); rank 0 is still scanning or waiting then.
CLI_RANK_1_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from plate_inspect import scanner

    if os.environ["RANK"] == "1":
        _compute, calls = scanner._compute, [0]

        def die_in_second_part(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 8:  # the first module of its second part: rank 0 is still scanning or waiting
                os.kill(os.getpid(), signal.SIGKILL)
            return _compute(*args, **kwargs)

        scanner._compute = die_in_second_part

    from plate_inspect.cli.main import main

    sys.argv = ["plate-inspect", "scan", *sys.argv[1:]]
    main()
    """
)
