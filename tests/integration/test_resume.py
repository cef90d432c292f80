"""A peer restarted from its checkpoint rejoins the running peers.

The rejoin protocol with peers as threads over ZeroMQ (exact oracle), then end to end: real
`gossip peer` processes, one SIGKILLed mid-run and restarted with --resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gossip import checkpoint
from gossip.config import TrainConfig
from gossip.errors import RejoinError
from gossip.metrics import MetricsWriter, read_jsonl
from gossip.ports import free_ports
from gossip.peer import Peer
from gossip.strategies.matcha import Matcha, MatchaOptions
from gossip.training.synchronous import train
from support import peer_once_all_bound, wait_until

ROUNDS, EVERY, VICTIM = 40, 5, 2


class Killed(Exception):
    pass


@pytest.mark.parametrize("strategy, options", [("dpsgd", {}), ("matcha", {"budget": 0.5})])
def test_a_restarted_peer_rejoins_with_its_checkpointed_value(strategy, options,
                                                               local_topology, run_peers):
    """The victim dies once every peer finished round ``dies_before - 1`` and comes back at
    once from its value of round ``checkpoint`` (its "checkpoint"). Its neighbours re-send
    what the dead incarnation missed, so every round equals the oracle: the same mixing, the
    victim's value swapped for its checkpointed one where it resumes."""
    topology = local_topology("exponential-8")
    size, rounds, checkpoint, dies_before, victim = 8, 30, 5, 8, 3
    x0 = torch.randn(size, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    all_bound = threading.Barrier(size, timeout=10)
    before_death = threading.Barrier(size, timeout=10)
    resumed_at: list[int] = []

    def open_peer(rank):
        return Peer(rank, topology, strategy, timeout=10, dead_after=10, keep_for_rejoin=True,
                    **options)

    def main(rank: int) -> torch.Tensor:
        results, x, saved = [], x0[rank].clone(), None
        try:
            with peer_once_all_bound(rank, topology, strategy, all_bound, timeout=10,
                                     dead_after=10, keep_for_rejoin=True, **options) as peer:
                for round in range(rounds):
                    if round == checkpoint:
                        saved = x.clone()
                    if round == dies_before:
                        before_death.wait()
                        if rank == victim:
                            peer.transport.close()  # no goodbye: killed
                            raise Killed
                    x = peer.synchronize(x, round)
                    results.append(x.clone())
                assert peer.lost_peers == {}
        except Killed:
            with open_peer(rank) as peer:  # the restart: same rank, same address
                start = peer.rejoin(checkpoint)
                resumed_at.append(start)
                x = saved
                results += [torch.full_like(x, torch.nan)] * (start - len(results))
                for round in range(start, rounds):
                    x = peer.synchronize(x, round)
                    results.append(x.clone())
        return torch.stack(results)

    results = torch.stack(run_peers(size, main, timeout=60), dim=1)
    (start,) = resumed_at
    if strategy == "dpsgd":  # its neighbours all wait for its message of the death round
        mixing = [topology.mixing_matrix()] * rounds
        assert start == dies_before
    else:  # the first round from there on in which one of its edges is active
        plan = Matcha(rank=0, topology=topology, transport=_NoTransport(),
                      options=MatchaOptions(**options)).plan
        mixing = [_matcha_w(plan, 0, k) for k in range(rounds)]
        assert start >= dies_before
        assert any(mixing[start][victim, j] for j in range(size) if j != victim)
    x, expected = x0.numpy().copy(), []
    for k in range(rounds):
        if k == start:
            x[victim] = expected[checkpoint - 1][victim]
        x = mixing[k] @ x
        expected.append(x)
    expected = torch.from_numpy(np.stack(expected))
    survivors = [r for r in range(size) if r != victim]
    torch.testing.assert_close(results[dies_before:, survivors],
                               expected[dies_before:, survivors], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(results[start:, victim], expected[start:, victim], rtol=1e-10,
                               atol=1e-10)


class _NoTransport:
    def connect(self, ranks):
        pass


def _matcha_w(plan, seed: int, round: int) -> np.ndarray:
    w = np.eye(plan.size)
    draws = np.random.default_rng([seed, round]).random(len(plan.matchings))
    for j, p in enumerate(plan.probabilities):
        if draws[j] < p:
            for a, b in plan.matchings[j]:
                w[a, b] = w[b, a] = plan.alpha
                w[a, a] -= plan.alpha
                w[b, b] -= plan.alpha
    return w


def start(rank: int, tmp_path: Path, meeting: list[str], *extra: str) -> subprocess.Popen:
    with open(tmp_path / f"peer-{rank}{'-resumed' if extra else ''}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gossip", "peer", "--rank", str(rank), *meeting,
             "--topology", str(tmp_path / "ring.yaml"), "--run-dir", str(tmp_path / "run"),
             "--quiet", "--rounds", str(ROUNDS), "--checkpoint-every", str(EVERY),
             "--timeout", "60",
             # The restart (a new Python, torch imported) must come back before its
             # neighbours give up on it: a rejoin, not a death.
             "--dead-after", "40", "--compute-delay", "0.03", *extra],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def ring_of_four(tmp_path: Path, meeting: str) -> list[str]:
    """Write the ring's topology file; returns the `gossip peer` flags that meet there.
    ``static``: the file lists every address, a restart binds its port again;
    ``rendezvous``: a graph-only file and rank 0's store, every start binds an ephemeral
    port, so the restarted peer comes back at a new address its join carries."""
    edges = [[r, (r + 1) % 4] for r in range(4)]
    if meeting == "rendezvous":
        (tmp_path / "ring.yaml").write_text(yaml.safe_dump({"edges": edges}))
        store = free_ports(1)[0]
        return ["--rendezvous", f"tcp://127.0.0.1:{store}?world_size=4"]
    (tmp_path / "ring.yaml").write_text(yaml.safe_dump({
        "peers": [{"rank": r, "host": "127.0.0.1", "port": p}
                  for r, p in enumerate(free_ports(4))], "edges": edges}))
    return []


@pytest.mark.slow
@pytest.mark.parametrize("meeting", ["static", "rendezvous"])
def test_a_killed_peer_resumes_from_its_checkpoint_and_rejoins(tmp_path, meeting):
    flags = ring_of_four(tmp_path, meeting)
    metrics = tmp_path / "run" / f"peer-{VICTIM}.jsonl"
    procs = {rank: start(rank, tmp_path, flags) for rank in range(4)}
    try:
        def victim_under_way() -> bool:
            assert all(p.poll() is None for p in procs.values()), _logs(tmp_path)
            return metrics.exists() and len(read_jsonl(metrics)) >= 2 * EVERY + 3

        wait_until(victim_under_way, 90, f"the victim to get {2 * EVERY + 3} rounds in")
        os.kill(procs[VICTIM].pid, signal.SIGKILL)
        procs[VICTIM].wait()
        died_after = len(read_jsonl(metrics))  # rounds it had completed
        procs[VICTIM] = start(VICTIM, tmp_path, flags, "--resume")
        for rank, proc in procs.items():
            assert proc.wait(timeout=120) == 0, _logs(tmp_path)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    records = {rank: read_jsonl(tmp_path / "run" / f"peer-{rank}.jsonl") for rank in range(4)}
    for rank in range(4):  # every round once, the victim's file rewritten after its restart
        assert [r["round"] for r in records[rank]] == list(range(ROUNDS)), rank
        assert records[rank][-1]["lost_peers"] == {}  # a rejoin is not a loss
    resumed = [r for r in records[VICTIM] if "resumed_from" in r]
    assert len(resumed) == 1
    checkpoint_round, rejoined_at = resumed[0]["resumed_from"], resumed[0]["round"]
    # At most one checkpoint interval of its own progress lost, and it rejoined where its
    # neighbours were waiting (at most a round behind where it died).
    assert checkpoint_round % EVERY == 0
    assert 0 <= died_after - checkpoint_round <= EVERY, (died_after, checkpoint_round)
    assert died_after - 1 <= rejoined_at <= died_after + 1, (died_after, rejoined_at)
    final = [records[rank][-1] for rank in range(4)]
    assert all(r["accuracy"] > 0.8 for r in final), final
    # Its byte counts go on from before the kill instead of restarting at 0.
    sent = [r["bytes_sent"] for r in records[VICTIM]]
    assert sent == sorted(sent), sent
    assert sent[-1] >= 0.9 * final[(VICTIM + 2) % 4]["bytes_sent"], (sent[-1], final)
    # The last round's probe ran over all four peers again: they agree closely.
    assert final[0]["consensus"] is not None and final[0]["consensus"] < 0.05
    assert "resumed from the checkpoint of round" in (
        tmp_path / f"peer-{VICTIM}-resumed.log").read_text()
    moved = f"peer {VICTIM} restarted at tcp://127.0.0.1:"
    for neighbour in ((VICTIM - 1) % 4, (VICTIM + 1) % 4):  # its join said where it is now
        assert (moved in (tmp_path / f"peer-{neighbour}.log").read_text()) == (
            meeting == "rendezvous"), neighbour


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted(tmp_path.glob("peer-*.log")))


# -- a round sent but not recorded; a job that has finished --------------------------------


class KilledWhileRecording(MetricsWriter):
    """A metrics file whose process is killed just before it records round ``at``: that
    round's messages are out, its line is not."""

    def __init__(self, path, at: int):
        super().__init__(path)
        self.at = at

    def write(self, record):
        if record["round"] == self.at:
            raise Killed
        super().write(record)


def test_a_round_sent_but_not_recorded_before_a_kill_gets_a_lost_work_line(tmp_path,
                                                                            local_topology,
                                                                            run_peers):
    """The leaf of a line 0-1-2 dies after sending round 8, before recording it; its
    neighbour finished round 8 and waits at round 9, so the restarted leaf rejoins at 9.
    Round 8 must still have its line ("one line per round"), marked as lost work."""
    line = local_topology("line", 3)
    config = TrainConfig(rounds=12, checkpoint_every=5, eval_every=1000, batch_size=16,
                         timeout=20, dead_after=20)
    victim, dies_at = 2, 8
    path = tmp_path / f"peer-{victim}.jsonl"
    ckpt = checkpoint.path_for(tmp_path, victim)
    neighbour_done = threading.Event()

    def open_peer(rank: int) -> Peer:
        return Peer(rank, line, "dpsgd", timeout=20, dead_after=20, keep_for_rejoin=True)

    def on_round(rank: int, record: dict) -> None:
        if rank == 1 and record["round"] == dies_at:
            neighbour_done.set()

    def main(rank: int) -> None:
        if rank != victim:
            with open_peer(rank) as peer:
                train(peer, config, on_round=lambda r: on_round(rank, r))
            return
        with pytest.raises(Killed):
            with open_peer(rank) as peer, KilledWhileRecording(path, dies_at) as metrics:
                train(peer, config, metrics=metrics, checkpoint_path=ckpt)
        assert neighbour_done.wait(20)  # it mixed our round 8 and asks for round 9
        history = read_jsonl(path)
        with open_peer(rank) as peer, MetricsWriter(path) as metrics:
            train(peer, config, metrics=metrics, checkpoint_path=ckpt, resume=True,
                  history=history)

    run_peers(3, main, timeout=90)
    records = read_jsonl(path)
    assert [r["round"] for r in records] == list(range(12))
    lost = records[dies_at]
    assert lost["lost_work"] is True and lost["loss"] is None and lost["accuracy"] is None
    assert lost["bytes_sent"] == records[dies_at - 1]["bytes_sent"]
    assert records[dies_at + 1]["resumed_from"] == 5  # its checkpoint: rounds 5-8 redone
    assert not any(r.get("lost_work") for r in records[:dies_at] + records[dies_at + 1:])


def test_a_restarted_peer_whose_job_has_finished_fails_at_once(local_topology):
    """Nobody listens at any other peer's address: waiting the whole --timeout for answers
    to its join helps nobody."""
    topology = local_topology("ring", 4)
    start = time.monotonic()
    with pytest.raises(RejoinError, match="no peer is running"):
        with Peer(3, topology, "dpsgd", timeout=60, dead_after=1, keep_for_rejoin=True) as peer:
            peer.rejoin(5)
    assert time.monotonic() - start < 30  # not the 60 s timeout
