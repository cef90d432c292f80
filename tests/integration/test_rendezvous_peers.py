"""Peers that meet through a launcher's store: as threads under a fake MPI launcher, and as
`gossip peer` processes under a fake SLURM one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gossip.metrics import read_jsonl
from gossip.ports import PortPicker, free_ports
from gossip.peer import Peer
from gossip.rendezvous import Rendezvous
from gossip.topology import Topology

REPO = Path(__file__).resolve().parents[2]


def test_peers_under_mpi_meet_on_ephemeral_ports_and_keep_the_same_host_path(run_peers):
    """Three peers whose ranks come from Open MPI's variables, on a graph-only topology,
    advertising 127.0.0.2 (not an address the static rule counts as local): each binds a
    port of its own choosing, the others reach it there, and being on one machine (same
    host name, boot id and network namespace) they still talk over Unix sockets and shared
    memory. Their D-PSGD round equals the W @ x oracle."""
    size, n = 3, 20_001  # large frames (> 64 KiB) take the shared-memory path
    port = free_ports(1)[0]
    graph_only = Topology.from_dict({"graph": {"kind": "ring"}}, size=size)
    x = torch.randn(size, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def main(rank):
        env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size)}
        rendezvous = Rendezvous.parse(f"tcp://127.0.0.1:{port}", environ=env,
                                      advertise="127.0.0.2", timeout=10)
        with Peer(rendezvous.rank_of(), graph_only, "dpsgd", rendezvous=rendezvous,
                  timeout=10) as peer:
            mixed = [x[rank]]
            for round in range(3):  # the shared-memory handshake rides on the first frames
                mixed.append(peer.synchronize(mixed[-1], round))
            shared = [peer.transport.shares_memory_with(j)
                      for j in peer.topology.neighbors(rank)]
            return mixed[1:], peer.topology, shared

    results = run_peers(size, main)
    topologies = {topology for _, topology, _ in results}
    assert len(topologies) == 1  # every peer learned the same addresses
    (met,) = topologies
    assert {p.host for p in met.peers} == {"127.0.0.2"}
    assert len({p.port for p in met.peers}) == size
    assert met.edges() == graph_only.edges()
    w, oracle = graph_only.mixing_matrix(), x.numpy()
    for round in range(3):
        oracle = w @ oracle
        for rank, (mixed, _, _) in enumerate(results):
            np.testing.assert_allclose(mixed[round].numpy(), oracle[rank], rtol=1e-12, atol=1e-12)
    for rank, (_, _, shared) in enumerate(results):
        assert all(shared), f"rank {rank} sends its neighbours large frames over the socket"


def _ipv6_loopback_missing() -> str | None:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        return f"no IPv6 loopback (::1) to bind: {exc.strerror or exc}"
    return None


@pytest.mark.skipif(_ipv6_loopback_missing() is not None,
                    reason=str(_ipv6_loopback_missing()))
@pytest.mark.parametrize("local_ipc", [False, True], ids=["tcp", "unix-socket"])
def test_peers_meet_and_talk_over_ipv6(local_ipc, run_peers):
    """A store at tcp://[::1]:PORT (rank 0 serves it), peers that bind and publish IPv6
    addresses and reach each other at them: over TCP, and over the same-host Unix sockets
    their IPv6 endpoints name. Three peers, a vector of odd length: D-PSGD equals W @ x."""
    size, n = 3, 1_001
    port = free_ports(1)[0]  # c10d's server listens on IPv4 and IPv6 alike
    graph_only = Topology.from_dict({"graph": {"kind": "ring"}}, size=size)
    x = torch.randn(size, n, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def main(rank):
        env = {"PMI_RANK": str(rank), "PMI_SIZE": str(size)}
        rendezvous = Rendezvous.parse(f"tcp://[::1]:{port}", environ=env, timeout=20)
        with Peer(rendezvous.rank_of(), graph_only, "dpsgd", rendezvous=rendezvous,
                  timeout=20, local_ipc=local_ipc) as peer:
            mixed = [x[rank]]
            for round in range(2):
                mixed.append(peer.synchronize(mixed[-1], round))
            return mixed[1:], peer.topology

    results = run_peers(size, main)
    (met,) = {topology for _, topology in results}
    assert [p.host for p in met.peers] == ["::1"] * size
    assert len({p.port for p in met.peers}) == size
    w, oracle = graph_only.mixing_matrix(), x.numpy()
    for round in range(2):
        oracle = w @ oracle
        for rank, (mixed, _) in enumerate(results):
            np.testing.assert_allclose(mixed[round].numpy(), oracle[rank], rtol=1e-12, atol=1e-12)


def _slurm_job_with_free_store_ports(steps: int) -> int:
    """A job id whose steps' derived store ports are free on this machine now."""
    for _ in range(100):
        job = free_ports(1)[0]
        ports = sorted({Rendezvous.parse("slurm://", environ={
            "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step),
            "SLURM_STEP_NODELIST": "localhost"}).port for step in range(steps)})
        try:
            PortPicker(ports, start=0).take(len(ports))
        except OSError:
            continue
        return job
    pytest.fail("no SLURM job id with free store ports in 100 tries")


def test_concurrent_slurm_steps_of_one_allocation_each_meet_their_own_peers(run_peers):
    """`srun -n 3 ... & srun -n 2 ... &` in one allocation: the two steps share the job id
    and the first node. Each step serves its own store (a port of its own) under keys of its
    own, so every peer meets only its step's peers: each step's D-PSGD rounds equal its own
    W @ x (before, a peer read the other step's addresses)."""
    sizes = (3, 2)
    job = _slurm_job_with_free_store_ports(len(sizes))
    graphs = [Topology.from_dict({"graph": {"kind": "ring"}}, size=size) for size in sizes]
    data = [torch.randn(size, 101, generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64) for step, size in enumerate(sizes)]
    tasks = [(step, rank) for step, size in enumerate(sizes) for rank in range(size)]

    def main(task):
        step, rank = tasks[task]
        env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step),
               "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(sizes[step]),
               "SLURM_STEP_NODELIST": "localhost"}
        rendezvous = Rendezvous.parse("slurm://", environ=env, timeout=20)
        with Peer(rendezvous.rank_of(), graphs[step], "dpsgd", rendezvous=rendezvous,
                  timeout=20) as peer:
            mixed = [data[step][rank]]
            for round in range(2):
                mixed.append(peer.synchronize(mixed[-1], round))
            return mixed[1:], peer.topology

    results = run_peers(len(tasks), main)
    for step, size in enumerate(sizes):
        mine = [result for (s, _), result in zip(tasks, results) if s == step]
        (met,) = {topology for _, topology in mine}
        assert met.size == size
        w, oracle = graphs[step].mixing_matrix(), data[step].numpy()
        for round in range(2):
            oracle = w @ oracle
            for rank, (mixed, _) in enumerate(mine):
                np.testing.assert_allclose(mixed[round].numpy(), oracle[rank], rtol=1e-12,
                                           atol=1e-12)
    ports = [{p.port for p in topology.peers} for (_, topology) in results]
    assert not ports[0] & ports[sizes[0]]  # no peer of one step is a peer of the other


def _slurm_env(rank: int, size: int, job: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(size), "SLURM_JOB_ID": str(job),
            "SLURM_STEP_NODELIST": "localhost,node[02-03]", "SLURM_LOCALID": str(rank)}


@pytest.mark.slow
@pytest.mark.launchers  # opt-in: pytest -m launchers
def test_gossip_peers_under_a_fake_srun_train_and_rank_0_writes_the_topology(tmp_path):
    """`srun -n 3 gossip peer --rendezvous slurm:// --topology ring.yaml` with SLURM's
    variables faked: the store is on the first node of the node list (localhost), its port
    derived from the job id; the graph-only file gets its size from SLURM_NTASKS."""
    size, port = 3, free_ports(1, host="127.0.0.1")[0]
    job = port - 20000 if 20000 <= port < 30000 else None
    uri = "slurm://" if job is not None else f"slurm://localhost:{port}"
    (tmp_path / "ring.yaml").write_text("graph: {kind: ring}\n")
    command = [sys.executable, "-m", "gossip", "peer", "--rendezvous", uri, "--topology",
               str(tmp_path / "ring.yaml"), "--run-dir", str(tmp_path), "--rounds", "2",
               "--quiet", "--timeout", "120"]
    procs = [subprocess.Popen(command, env=_slurm_env(rank, size, job or 7),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(size)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=400)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * size, outputs
    written = yaml.safe_load((tmp_path / "topology.yaml").read_text())
    assert written["edges"] == [[0, 1], [0, 2], [1, 2]] and len(written["peers"]) == size
    resumed = Topology.from_yaml(tmp_path / "topology.yaml")  # resume and plots read it
    assert resumed.size == size
    for rank in range(size):
        assert [r["round"] for r in read_jsonl(tmp_path / f"peer-{rank}.jsonl")] == [0, 1]


def test_a_peer_restarted_at_a_new_address_is_reached_there():
    """Rank 1 comes back on another (ephemeral) port; its join carries the new endpoint, so
    rank 0 re-points its socket: the welcome and the next messages go there, not to the
    dead process's address."""
    from contextlib import suppress

    from gossip.errors import PeerTimeout
    from gossip.rendezvous.meet import UNKNOWN
    from gossip.transport import Message, ZmqTransport
    from support.waiting import read_until

    def transport(rank):
        ends = [UNKNOWN, UNKNOWN]
        ends[rank] = "tcp://127.0.0.1:*"
        opened = ZmqTransport(rank, ends, timeout=5.0).open()
        opened.accept_kinds(["gossip"])
        return opened

    t0, t1 = transport(0), transport(1)
    try:
        t0.locate([UNKNOWN, t1.endpoints[1]], set())
        t1.locate([t0.endpoints[0], UNKNOWN], set())
        t0.send(1, Message("gossip", 0, buffers=(torch.ones(3),)))
        assert t1.recv(src=0, kind="gossip", round=0).buffers[0].tolist() == [1.0] * 3
        old = t1.endpoints[1]
        t1.close()
        t1 = transport(1)
        assert t1.endpoints[1] != old
        t1.locate([t0.endpoints[0], UNKNOWN], set())
        t1.send(0, Message("ctl.join", 0, meta={"round": 0, "endpoint": t1.endpoints[1]}))
        # Its hello re-points rank 0; its join (queued until rank 0's socket says hello at
        # the new address) then gets the welcome: both read on, as running peers do.
        read_until(t0, lambda: t0.endpoints[1] == t1.endpoints[1], "rank 0 to read the hello")

        def welcomed() -> bool:
            with suppress(PeerTimeout):
                t0.recv(kind="gossip", round=-5, timeout=0.02)  # reads the join, answers it
            return 0 in t1.membership._welcomes

        read_until(t1, welcomed, "the welcome at the new address")
        t0.send(1, Message("gossip", 1, buffers=(torch.full((3,), 2.0),)))
        assert t1.recv(src=0, kind="gossip", round=1).buffers[0].tolist() == [2.0] * 3
    finally:
        t0.close()
        t1.close()


@pytest.mark.slow
def test_peers_in_namespaces_advertise_their_own_ip_and_talk_over_the_links(tmp_path):
    """Two peers in the netns virtual cluster (one machine, one host name and boot id, but
    their own network stacks) meet at rank 0's store: each advertises its namespace's IP
    (the source address towards the store) and, not being on one machine by the
    namespace, they talk over TCP: every byte crosses the capped links."""
    from gossip.cluster import VirtualCluster, unavailable_reason
    from gossip.launching import processes as launcher

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"netns virtual cluster unavailable: {reason}")
    (tmp_path / "line.yaml").write_text("edges: [[0, 1]]\n")
    with VirtualCluster(2, rate="1gbit") as cluster:
        procs = launcher.start_peers([0, 1], tmp_path, [
            "--rendezvous", f"tcp://{cluster.host(0)}:29500?world_size=2", "--topology",
            str(tmp_path / "line.yaml"), "--rounds", "2", "--timeout", "120"],
            wrap=cluster.command)
        deadline = time.monotonic() + 300

        def on_progress(_done: int) -> None:
            if time.monotonic() > deadline:
                raise TimeoutError("peers still running after 300 s")

        try:
            launcher.watch(procs, on_progress)
        finally:
            launcher.stop(procs)
        met = Topology.from_yaml(tmp_path / "topology.yaml")
        assert [p.host for p in met.peers] == [cluster.host(0), cluster.host(1)]
        for rank in range(2):
            last = read_jsonl(tmp_path / f"peer-{rank}.jsonl")[-1]
            assert last["round"] == 1 and last["bytes_sent"] > 0
            assert cluster.link_bytes(rank)["sent"] > last["bytes_sent"]
