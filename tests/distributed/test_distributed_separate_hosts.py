"""Scans whose nodes are separate hosts: two network namespaces joined by a veth pair, each with an address of its
own and one torchrun agent (``--nnodes 2``), on one machine's filesystem. Unlike several agents on 127.0.0.1, a
rank here reaches the other only over the link, and a node cut off (its link down) closes no connection: the other
hears nothing, as when a node loses its network or its power. Needs root and iproute2 (skipped otherwise; CI runs
as root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_distributed import (
    EXE,
    SCAN_NOTING_PARTS,
    run,
    start_agents,
    two_hosts,
    wait_agents,
)
from oracles import assert_same_bundle
from safetensors.torch import load_file

from plate_inspect.bundle import Bundle


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
        agents = start_agents(hosts, script, marks, 0.0, _scan_args(four_layers.path, out), "hosts-ok")
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
print(json.dumps([gloo_interface(env, host) for env, host in json.loads(sys.argv[1])]))
"""


def test_gloo_listens_on_the_interface_that_reaches_the_store_when_the_host_name_is_loopback():
    """On host 0, whose name (here `localhost`, or one that resolves nowhere) gives gloo a loopback address: the
    interface for the job's store on host 1 is host 0's end of the link; nothing is chosen for a store on loopback,
    a host name gloo can use (host 0's own address), or when the user named one (GLOO_SOCKET_IFNAME)."""
    with two_hosts() as hosts:
        store = {"MASTER_ADDR": hosts.addresses[1], "MASTER_PORT": "29500"}
        cases = [
            (store, "localhost"),
            (store, "no-such-host.invalid"),
            ({**store, "MASTER_ADDR": "127.0.0.1"}, "localhost"),
            (store, hosts.addresses[0]),
            ({**store, "GLOO_SOCKET_IFNAME": "lo"}, "localhost"),
        ]
        cmd = hosts.exec(0, [sys.executable, "-c", _GLOO_INTERFACE, json.dumps(cases)])
        chosen = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        assert chosen == [hosts.links[0], hosts.links[0], None, None, None]
