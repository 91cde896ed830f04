"""Running distributed scans in tests (distributed/): the plate-inspect console script, torchrun with two ranks on
one node, a subprocess that cannot outlive its test, the store and environment torchrun gives rank 1, and two hosts
of their own (network namespaces) with a torchrun agent on each."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


# ------------------------------------------------------------------ two hosts of their own: network namespaces
@dataclass(frozen=True)
class TwoHosts:
    """Two network namespaces joined by a veth pair: separate hosts with their own addresses (``10.a.b.1`` and
    ``.2``) and no other way to reach each other, on this machine's filesystem (a shared directory for free)."""

    namespaces: tuple[str, str]
    links: tuple[str, str]
    addresses: tuple[str, str]

    def exec(self, node: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on host ``node``."""
        return ["ip", "netns", "exec", self.namespaces[node], *cmd]

    def link(self, node: int, state: str) -> None:
        """Host ``node``'s network cable in (``up``) or out (``down``): with it out, its packets go nowhere and
        the other host hears nothing (no connection is closed), as when a node is cut off or powered off."""
        subprocess.run(["ip", "-n", self.namespaces[node], "link", "set", self.links[node], state], check=True)

    def end_processes(self) -> None:
        """SIGKILL every process still running on either host (all started by the test that made them)."""
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    @contextlib.contextmanager
    def etc_hosts(self, node: int, text: str) -> Iterator[None]:
        """``text`` as host ``node``'s /etc/hosts (`ip netns exec` shows /etc/netns/NS/hosts in its place)."""
        etc = Path("/etc/netns") / self.namespaces[node]
        etc.mkdir(parents=True)
        try:
            (etc / "hosts").write_text(text)
            yield
        finally:
            (etc / "hosts").unlink(missing_ok=True)
            etc.rmdir()

    def net_inode(self, node: int) -> int:
        """The namespace's identity, as /proc/PID/ns/net shows it for a process running on host ``node``."""
        return os.stat(f"/run/netns/{self.namespaces[node]}").st_ino


def separate_hosts_unavailable() -> str | None:
    """Why this machine cannot make network namespaces (not root, no iproute2), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (tests of separate hosts run as root, as in CI)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` (not installed)"
    return None


@contextlib.contextmanager
def two_hosts(subnet: str | None = None) -> Iterator[TwoHosts]:
    """Two fresh network namespaces with unique names (process id and a random tag), each with its end of a veth
    pair up; every process still running in them is SIGKILLed (all were started by this test) and both are
    deleted afterwards, on failure too. A machine that refuses them (a container without CAP_SYS_ADMIN) skips.
    Their addresses: ``subnet`` (three octets) .1 and .2, by default a random 10.a.b."""
    import pytest

    reason = separate_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"pi{os.getpid() % 100000}{secrets.token_hex(2)}"  # interface names: at most 15 characters
    subnet = subnet or f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
    hosts = TwoHosts((f"{tag}n0", f"{tag}n1"), (f"{tag}v0", f"{tag}v1"), (f"{subnet}.1", f"{subnet}.2"))
    made: list[str] = []
    try:
        for ns in hosts.namespaces:
            added = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if added.returncode != 0:
                pytest.skip(f"this machine cannot make network namespaces: {added.stderr.strip()}")
            made.append(ns)
        setup = [["ip", "link", "add", hosts.links[0], "type", "veth", "peer", "name", hosts.links[1]]]
        for node in (0, 1):
            ns, link = hosts.namespaces[node], hosts.links[node]
            setup += [["ip", "link", "set", link, "netns", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
                      ["ip", "-n", ns, "addr", "add", f"{hosts.addresses[node]}/24", "dev", link],
                      ["ip", "-n", ns, "link", "set", link, "up"]]  # fmt: skip
        for cmd in setup:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"this machine cannot link network namespaces ({' '.join(cmd)}): {done.stderr.strip()}")
        yield hosts
    finally:
        if len(made) == 2:
            hosts.end_processes()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


#: A rank's script on a host of its own (argv: marks directory, seconds per module on node 0 and on node 1 as
#: ``0.0,3.0``, then scan's arguments): ``marks/computing-<node>`` once it starts its first module, and each part file
#: it writes noted in ``marks/wrote-<node>`` with the network namespace it ran in; SCAN_RECORDING_EXIT.
SCAN_NOTING_PARTS = (
    textwrap.dedent(
        """
        import os, sys, time
        from pathlib import Path
        from plate_inspect import bundle_writer, scanner

        marks, rank, node = Path(sys.argv[1]), os.environ["RANK"], os.environ["GROUP_RANK"]
        delay, net = float(sys.argv[2].split(",")[int(node)]), os.stat("/proc/self/ns/net").st_ino
        sys.argv[1:3] = []
        _write, _compute = bundle_writer.BundleWriter.write_part, scanner._compute

        def write_part(self, part, *args, **kwargs):
            _write(self, part, *args, **kwargs)
            with open(marks / f"wrote-{node}", "a") as f:
                f.write(f"{part} {net}\\n")

        def compute(*args, **kwargs):
            (marks / f"computing-{node}").touch()
            time.sleep(delay)
            return _compute(*args, **kwargs)

        bundle_writer.BundleWriter.write_part = write_part
        scanner._compute = compute
        """
    )
    + SCAN_RECORDING_EXIT
)


@dataclass
class Agent:
    """One torchrun agent (a node of the job) and its output, each line with the time it came."""

    popen: subprocess.Popen
    lines: list[tuple[float, str]]
    reader: threading.Thread

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def when(self, start: str) -> float | None:
        """When the first line starting with ``start`` came (time.monotonic()), or None."""
        return next((t for t, line in self.lines if line.startswith(start)), None)


def start_agents(hosts: TwoHosts, script: Path, marks: Path, delays: tuple[float, float], scan_args: list[str],
                 run_id: str, names: tuple[str, str] | None = None,
                 envs: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> list[Agent]:  # fmt: skip
    """One torchrun agent per host (``--nnodes 2``, one rank each, c10d rendezvous on host 0's address, which
    hosts the store: ``is_host``, since both hosts share this machine's name), running ``script`` with ``marks``,
    ``delays`` (seconds per module on each node) and ``scan_args``; output read line by line as it comes. The hosts
    are named by their addresses, or by ``names`` (in their /etc/hosts) in the endpoint and ``--local-addr``. The
    node whose name sorts first becomes GROUP_RANK 0 (torch's c10d rendezvous sorts them), holds the job's store
    (torchrun's agent store, a port of its own) and gives its name to every rank as MASTER_ADDR: host 0 here.
    ``envs``: more environment variables for each host's agent and ranks."""
    agents = []
    env = {**{k: v for k, v in os.environ.items() if k not in JOB_VARS}, **ONE_THREAD}
    names = names or hosts.addresses
    assert sorted(names) == list(names), names
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{names[0]}:29500", "--rdzv-id", run_id,
               "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", names[node],
               "--", str(script), str(marks), ",".join(map(str, delays)), *scan_args]  # fmt: skip
        popen = subprocess.Popen(hosts.exec(node, cmd), env={**env, **envs[node]}, text=True, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        lines: list[tuple[float, str]] = []

        def read(popen: subprocess.Popen = popen, lines: list[tuple[float, str]] = lines) -> None:
            for line in popen.stdout:  # type: ignore[union-attr]
                lines.append((time.monotonic(), line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        agents.append(Agent(popen, lines, reader))
    return agents


def wait_agents(agents: list[Agent], timeout: float) -> list[int | None]:
    """Each agent's exit code once it ends, None for one still running after ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    for agent in agents:
        if agent.popen.poll() is not None:
            agent.reader.join(timeout=5)
    return [agent.popen.poll() for agent in agents]
