"""Scans whose nodes are separate hosts: two network namespaces joined by a veth pair, each with an address of its
own and one torchrun agent (``--nnodes 2``), on one machine's filesystem. Unlike several agents on 127.0.0.1, a
rank here reaches the other only over the link, and a node cut off (its link down) closes no connection: the other
hears nothing, as when a node loses its network or its power. Needs root and iproute2 (skipped otherwise; CI runs
as root)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers_distributed import (
    EXE,
    JOB_VARS,
    ONE_THREAD,
    SCAN_NOTING_PARTS,
    run,
    start_agents,
    two_hosts,
    wait_agents,
)
from oracles import assert_same_bundle
from safetensors.torch import load_file

from plate_inspect.bundle import Bundle
from plate_inspect.errors import BundleError


@pytest.fixture(scope="module")
def reference(four_layers, tmp_path_factory) -> Path:
    """The single-process bundle of the four-layer model at r = 8."""
    out = tmp_path_factory.mktemp("reference") / "b"
    run([EXE, "scan", str(four_layers.path), "--out", str(out), "--r", "8", "--quiet"])
    return out


def _parts_written(marks: Path, node: int) -> list[tuple[str, int]]:
    path = marks / f"wrote-{node}"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(part, int(inode)) for part, inode in (line.split() for line in lines)]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _scan_args(model: Path, out: Path) -> list[str]:
    return [str(model), "--out", str(out), "--r", "8", "--quiet"]


def test_a_job_on_two_hosts_writes_the_single_process_bundle(four_layers, reference, tmp_path):
    """Each host's rank writes its share of the part files (layers 0 and 2 on node 0, 1 and 3 on node 1), from
    its own network namespace; the finished bundle is the single-process one, tensor for tensor, bit for bit, and
    its manifest complete. Before session 23 this failed at joining: this machine's name resolves to 127.0.0.1, so
    gloo listened on loopback on both hosts (`Gloo connectFullMesh failed ... remote=[127.0.0.1]`)."""
    script, marks, out = tmp_path / "rank.py", tmp_path / "marks", tmp_path / "b"
    script.write_text(SCAN_NOTING_PARTS)
    marks.mkdir()
    with two_hosts() as hosts:
        agents = start_agents(hosts, script, marks, (0.0, 0.0), _scan_args(four_layers.path, out), "hosts-ok")
        codes = wait_agents(agents, timeout=240)
        output = "\n".join(agent.output()[-3000:] for agent in agents)
        assert codes == [0, 0], output
        inodes = hosts.net_inode(0), hosts.net_inode(1)
    assert len(set(inodes)) == 2 and os.stat("/proc/self/ns/net").st_ino not in inodes
    layer = "layer-{:05d}.safetensors".format
    assert _parts_written(marks, 0) in (
        [(layer(0), inodes[0]), (layer(2), inodes[0])],
        [(layer(2), inodes[0]), (layer(0), inodes[0])],
    )
    assert sorted(_parts_written(marks, 1)) == [(layer(1), inodes[1]), (layer(3), inodes[1])]
    assert [(marks / f"exit-{rank}").read_text() for rank in (0, 1)] == ["0", "0"]
    assert_same_bundle(reference, out)
    for part in sorted(p.name for p in reference.glob("layer-*.safetensors")):
        want, got = load_file(reference / part), load_file(out / part)
        assert sorted(want) == sorted(got)
        for name, tensor in want.items():
            assert tensor.dtype == got[name].dtype and tensor.shape == got[name].shape, name
            assert torch.equal(_bits(tensor), _bits(got[name])), name
    bundle = Bundle.load(out)
    assert bundle.manifest.complete and len(bundle.manifest.modules) == 28


_GLOO_INTERFACE = """
import json, sys
from plate_inspect.distributed.network import gloo_interface
print(json.dumps([gloo_interface(env, host, nodes) for env, host, nodes in json.loads(sys.argv[1])]))
"""


@pytest.mark.slow
def test_gloo_listens_on_the_interface_that_reaches_the_store_when_the_host_name_is_loopback():
    """On host 0, whose name (here `localhost`, or one that resolves nowhere) gives gloo a loopback address: the
    interface for the job's store on host 1 is host 0's end of the link, and so it is on the store's own node
    (MASTER_ADDR loopback there) in a job of two nodes: its only interface that is not loopback. Nothing is chosen
    for a job of one node with its store on loopback, a host name gloo can use (host 0's own address), or when the
    user named one (GLOO_SOCKET_IFNAME)."""
    with two_hosts() as hosts:
        store = {"MASTER_ADDR": hosts.addresses[1], "MASTER_PORT": "29500"}
        on_store_node = {**store, "MASTER_ADDR": "127.0.0.1"}
        cases = [
            (store, "localhost", 2),
            (store, "no-such-host.invalid", 2),
            (store, "localhost", 1),  # (the store elsewhere: a job of one node all the same)
            (on_store_node, "localhost", 2),  # MASTER_ADDR is this host's name, mapped to 127.0.1.1
            (on_store_node, "localhost", 1),  # one machine
            (store, hosts.addresses[0], 2),
            ({**store, "GLOO_SOCKET_IFNAME": "lo"}, "localhost", 2),
        ]
        cmd = hosts.exec(0, [sys.executable, "-c", _GLOO_INTERFACE, json.dumps(cases)])
        chosen = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        link = hosts.links[0]
        assert chosen == [link, link, link, link, None, None, None]


SILENT = (
    "error: rank 1 has given no sign of life for 30 s (killed, stopped, or its node is down): stop the job; the part "
    "files finished so far are kept: rerun the same command to resume (with any number of ranks)"
)
LOST = "error: rank 1: lost contact with the job's store at {}:"
LOST_END = (
    ": it has not answered for 30 s; the first node (torchrun's agent or rank 0 there) is down, stopped or "
    "unreachable: stop the job; the part files finished so far are kept: rerun the same command to resume (with any "
    "number of ranks)"
)


def _lost_contact(agent, store_host: str) -> bool:
    """The agent's rank said one error line: that it lost the job's store on ``store_host`` (any port)."""
    errors = [line for _, line in agent.lines if line.startswith("error:")]
    return len(errors) == 1 and errors[0].startswith(LOST.format(store_host)) and errors[0].endswith(LOST_END)


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.05)


def _rerun_gives_the_reference(hosts, script, marks, model, out, reference) -> None:
    """Every process of the cut job gone and the link back: the same command on both hosts resumes the bundle to
    the single-process one."""
    hosts.end_processes()
    hosts.link(0, "up")
    hosts.link(1, "up")
    agents = start_agents(hosts, script, marks, (0.0, 0.0), _scan_args(model, out), "hosts-rerun")
    codes = wait_agents(agents, timeout=240)
    assert codes == [0, 0], "\n".join(agent.output()[-3000:] for agent in agents)
    assert_same_bundle(reference, out)


@pytest.mark.slow
def test_a_host_cut_off_mid_scan_ends_the_job_within_the_silence_limit_and_the_rerun_resumes(
    four_layers, reference, tmp_path
):
    """Host 1's link goes down while its rank scans (3 s per module: its share would take 42 s): no connection
    closes, the store on host 0 hears nothing. Rank 0, done with its share, names rank 1 after the silence limit
    (30 s) and its node's job ends; rank 1, whose store calls go unanswered, stops mid-share with the lost-contact
    line after the store bound (30 s), each with exit code 2. torchrun's agent on host 1 keeps waiting on the
    store (torch's own calls, not ours: README). Rerunning the same command resumes to the single-process bundle."""
    script, marks, out = tmp_path / "rank.py", tmp_path / "marks", tmp_path / "b"
    script.write_text(SCAN_NOTING_PARTS)
    marks.mkdir()
    with two_hosts() as hosts:
        agents = start_agents(hosts, script, marks, (0.0, 3.0), _scan_args(four_layers.path, out), "hosts-cut-1")
        _wait_for(marks / "computing-1", timeout=180)
        hosts.link(1, "down")
        down = time.monotonic()
        _wait_for(marks / "exit-1", timeout=90)
        codes = wait_agents(agents[:1], timeout=60)
        output = "\n".join(agent.output()[-3000:] for agent in agents)
        said_0, said_1 = agents[0].when(SILENT), agents[1].when(LOST.format(hosts.addresses[0]))
        assert said_0 is not None and said_1 is not None, output
        assert 30 <= said_0 - down < 45 and 30 <= said_1 - down < 45, (said_0 - down, said_1 - down)
        assert codes[0] not in (None, 0) and time.monotonic() - down < 60, output
        assert [(marks / f"exit-{rank}").read_text() for rank in (0, 1)] == ["2", "2"]
        assert _lost_contact(agents[1], hosts.addresses[0]), output
        assert len(_parts_written(marks, 1)) < 2  # it stopped mid-share
        with pytest.raises(BundleError, match="incomplete"):
            Bundle.load(out)
        _rerun_gives_the_reference(hosts, script, marks, four_layers.path, out, reference)


@pytest.mark.slow
def test_the_store_host_cut_off_mid_scan_stops_the_other_hosts_rank_and_the_rerun_resumes(
    four_layers, reference, tmp_path
):
    """Host 0 (torchrun's agent with the job's store, and rank 0) loses its link while rank 1 on host 1 scans (3 s
    per module): a vanished first node, as README's "A vanished first node" tells it with SIGSTOP. Rank 1's store
    calls go unanswered; it stops mid-share with the lost-contact line after the store bound (30 s), exit code 2.
    (Host 0 still runs here: its rank 0 names rank 1 as silent.) Rerunning resumes to the single-process bundle."""
    script, marks, out = tmp_path / "rank.py", tmp_path / "marks", tmp_path / "b"
    script.write_text(SCAN_NOTING_PARTS)
    marks.mkdir()
    with two_hosts() as hosts:
        agents = start_agents(hosts, script, marks, (0.0, 3.0), _scan_args(four_layers.path, out), "hosts-cut-0")
        _wait_for(marks / "computing-1", timeout=180)
        hosts.link(0, "down")
        down = time.monotonic()
        _wait_for(marks / "exit-1", timeout=90)
        stopped = time.monotonic() - down
        time.sleep(1)  # its line comes before its exit mark; let the reader take it
        output = agents[1].output()[-3000:]
        said = agents[1].when(LOST.format(hosts.addresses[0]))
        assert said is not None and 30 <= said - down < 45 and stopped < 45, (output, stopped)
        assert (marks / "exit-1").read_text() == "2"
        assert _lost_contact(agents[1], hosts.addresses[0]), output
        assert len(_parts_written(marks, 1)) < 2  # it stopped mid-share
        with pytest.raises(BundleError, match="incomplete"):
            Bundle.load(out)
        _rerun_gives_the_reference(hosts, script, marks, four_layers.path, out, reference)


_JOINING_RANK_1 = """
import sys
from plate_inspect import distributed, scanner

distributed.timing.JOIN_NOTE_SECONDS = 2.0
scanner.scan(sys.argv[1], sys.argv[2], r=8)
"""


def _first_note(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """The first `plate-inspect:` line on stderr of ``cmd`` (which is then killed), or what it printed instead."""
    with subprocess.Popen(cmd, env=env, text=True, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL) as popen:
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(popen.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and popen.poll() is None:
            notes = [line.strip() for line in list(seen) if line.startswith("plate-inspect:")]
            if notes:
                popen.kill()
                return notes[0]
            time.sleep(0.1)
        popen.kill()
        return "".join(seen)[-3000:]


@pytest.mark.slow
def test_a_rank_that_cannot_reach_master_addr_says_so_while_it_waits(four_layers, tmp_path):
    """Ranks started by hand whose MASTER_ADDR cannot be reached from their host: an address with no route, and a
    name (host 0's /etc/hosts) that resolves to an address on the link where no host is. torch retries for 24 h
    (COLLECTIVE_TIMEOUT); the rank's note used to blame the other ranks ("a rank that failed before joining ... or
    was never started"); it now says that the address cannot be reached and why."""
    script = tmp_path / "joining.py"
    script.write_text(_JOINING_RANK_1)
    with two_hosts() as hosts:
        absent = hosts.addresses[0].rsplit(".", 1)[0] + ".99"
        with hosts.etc_hosts(0, f"127.0.0.1 localhost\n{absent} first-node\n"):
            notes = {}
            for master in ("192.0.2.50", "first-node"):
                env = {**{k: v for k, v in os.environ.items() if k not in JOB_VARS}, **ONE_THREAD}
                env.update(WORLD_SIZE="2", RANK="1", MASTER_ADDR=master, MASTER_PORT="29500")
                cmd = hosts.exec(0, [sys.executable, str(script), str(four_layers.path), str(tmp_path / master)])
                notes[master] = _first_note(cmd, env, timeout=120)
    tail = (
        "MASTER_ADDR must be an address of the first node (rank 0's) that every node reaches; if it is wrong, stop "
        "the job"
    )
    assert notes["192.0.2.50"] == (
        "plate-inspect: rank 1 has waited 2 s to join the job at 192.0.2.50:29500 but cannot reach that address "
        f"(Network is unreachable): {tail}"
    ), notes
    assert notes["first-node"] == (
        "plate-inspect: rank 1 has waited 2 s to join the job at first-node:29500 but cannot reach that address "
        f"(No route to host): {tail}"
    ), notes


@pytest.mark.slow
def test_a_job_whose_store_host_maps_its_own_name_to_loopback_writes_the_bundle(four_layers, reference, tmp_path):
    """Debian's and Ubuntu's /etc/hosts map the host's own name to 127.0.1.1: host 0 (`head`, the store's host)
    resolves `head` to loopback and host 1 `node1`, each the other's name to its address; the ranks get
    MASTER_ADDR=head, which is loopback on host 0; the hosts' addresses are 192.168.77.1 and .2. The job writes the
    single-process bundle. Before, gloo on host 0 listened on loopback: the store's address gave no interface
    there, and of two gloo peers the one with the larger address connects to the other (192.168.77.2 to
    127.0.0.1: `Gloo connectFullMesh failed`; with 10.a.b addresses host 0 connected out and the job went through).
    Now host 0, in a job of two nodes, listens on its only interface that is not loopback."""
    script, marks, out = tmp_path / "rank.py", tmp_path / "marks", tmp_path / "b"
    script.write_text(SCAN_NOTING_PARTS)
    marks.mkdir()
    with two_hosts("192.168.77") as hosts:
        own, head, node1 = f"127.0.0.1 localhost {socket.gethostname()}\n", hosts.addresses[0], hosts.addresses[1]
        with (
            hosts.etc_hosts(0, own + f"127.0.1.1 head\n{node1} node1\n"),
            hosts.etc_hosts(1, own + f"127.0.1.1 node1\n{head} head\n"),
        ):
            args = _scan_args(four_layers.path, out)
            agents = start_agents(hosts, script, marks, (0.0, 0.0), args, "hosts-head", names=("head", "node1"))
            codes = wait_agents(agents, timeout=240)
        assert codes == [0, 0], "\n".join(agent.output()[-3000:] for agent in agents)
    assert_same_bundle(reference, out)
    assert sorted(_parts_written(marks, 0)) and sorted(_parts_written(marks, 1))


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [1, 0])
def test_a_rank_that_cannot_connect_over_gloo_says_one_line_and_the_job_ends(four_layers, tmp_path, wrong):
    """One host's ranks run with GLOO_SOCKET_IFNAME=lo (a wrong setting): gloo there listens on loopback, and the
    other host's rank, whose address (192.168.77.x) is the larger, connects to it and cannot. Before: that rank a
    C++ traceback (`Gloo connectFullMesh failed`) and no line; when it was rank 1, rank 0 kept waiting for its
    connection inside gloo (24 h; seen: notes at 60, 120, 180 s blaming a rank that failed). Now the failing rank
    says one line naming the address it could not reach and GLOO_SOCKET_IFNAME, and the job ends."""
    script, marks, out = tmp_path / "rank.py", tmp_path / "marks", tmp_path / "b"
    script.write_text(SCAN_NOTING_PARTS)
    marks.mkdir()
    failing = 1 - wrong
    with two_hosts("192.168.77") as hosts:
        args = _scan_args(four_layers.path, out)
        envs: list[dict[str, str]] = [{}, {}]
        envs[wrong] = {"GLOO_SOCKET_IFNAME": "lo"}
        started = time.monotonic()
        agents = start_agents(hosts, script, marks, (0.0, 0.0), args, "hosts-gloo", envs=(envs[0], envs[1]))
        codes = wait_agents(agents, timeout=150)
        took = time.monotonic() - started
        output = "\n".join(agent.output() for agent in agents)
    assert None not in codes and took < 120, output[-6000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: rank {failing} on node {failing} ({socket.gethostname()}): cannot connect to the job's other ranks "
        "over gloo (timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:"
    ), output
    assert errors[0].endswith("set GLOO_SOCKET_IFNAME on every node to the network interface the nodes share"), output
    assert "/plate_inspect/" not in output and "/cli/" not in output, output  # no traceback through plate-inspect
    assert (marks / f"exit-{failing}").read_text() == "2"
