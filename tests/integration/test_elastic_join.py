"""Joins in an elastic run: peers on the topology's spare ranks join running ring
all-reduce members (gossip/strategies/elastic.py, gossip/transport/epochs.py). Real peers over
ZeroMQ on loopback, each a thread of this process. Each peer keeps a "model": the running sum
of its round results, which its donor hands a joiner as bytes.
"""

from __future__ import annotations

import queue
import threading
import time

import msgpack
import pytest
import torch

from gossip.errors import ConfigError
from gossip.peer import Peer
from gossip.transport import LoopbackHub
from support import peer_once_all_bound
from support.waiting import pace_joins

TIMEOUT = 10.0
N = 23


class Killed(BaseException):
    """A member's way out of its thread once it "died"."""


def run_with_joins(run_peers, topology, *, members, rounds, joins, strategy="ring-allreduce",
                   kills=None, **options):
    """Ranks < ``members`` run from round 0; each rank in ``joins`` enters once rank 0
    completed round ``joins[rank]``, and rank 0 goes on only once its ask arrived (so it is
    admitted mid-run, whatever the machine's load). ``kills`` maps a member to the round
    after which it "dies" (closes its transport without a goodbye, as a kill -9 looks to the
    others). Every peer runs ``model += synchronize(x)`` with x its own input of the round.
    Returns per rank (first round it ran, its models after each round, by round) and each
    peer."""
    size, kills = topology.size, kills or {}
    x = torch.randn(size, rounds, N, generator=torch.Generator().manual_seed(size),
                    dtype=torch.float64)
    all_bound = threading.Barrier(size, timeout=TIMEOUT)
    progress = threading.Condition()
    done = [-1]
    peers: dict[int, Peer] = {}

    def main(rank: int):
        try:
            return run(rank)
        except Killed:
            return None

    def run(rank: int):
        with peer_once_all_bound(rank, topology, strategy, all_bound, timeout=TIMEOUT,
                                 dead_after=0.5, elastic=True, spares=size - members,
                                 **options) as peer:
            peers[rank] = peer
            if rank >= members:
                with progress:
                    assert progress.wait_for(lambda: done[0] >= joins[rank], timeout=TIMEOUT)
            return run_member(peer, x[rank], rounds, joiner=rank >= members,
                              dies=kills.get(rank), after_round=lambda round: rank == 0
                              and pace_joins(peer, round, progress, done, joins, TIMEOUT))

    return run_peers(size, main, timeout=6 * TIMEOUT), peers, x


def run_member(peer, x, rounds, *, joiner, dies=None, after_round=lambda round: None):
    """``model += peer.synchronize(x[round])`` each round, a joiner from its donor's model
    (None, {} if the run ended first); dies (closes its transport without a goodbye, as a
    kill -9 looks to the others) after round ``dies``. Returns the first round it ran and
    its models after each round, by round."""
    model, first, models = torch.zeros(N, dtype=torch.float64), 0, {}
    if joiner:
        entered = peer.enter()
        if entered is None:  # the run ended first
            return None, {}
        first, state = entered
        model = torch.frombuffer(bytearray(state), dtype=torch.float64).clone()
        models[first - 1] = model.clone()
    for round in range(first, rounds):
        model += peer.synchronize(x[round], round)
        models[round] = model.clone()
        peer.hand_over(round, lambda: model.numpy().tobytes())
        if dies == round:
            peer.transport.close()
            raise Killed
        after_round(round)
    return first, models


@pytest.mark.parametrize("strategy, options", [("ring-allreduce", {}),
                                               ("topk-allgather", {"density": 1.0}),
                                               ("topk-allgather", {"density": 0.5})])
def test_a_joiner_takes_its_donors_state_and_runs_bitwise_equal(strategy, options,
                                                                local_topology, run_peers):
    members, rounds = 4, 10
    topology = local_topology("ring", members + 1)
    outcome, peers, x = run_with_joins(run_peers, topology, members=members, rounds=rounds,
                                       joins={members: 2}, strategy=strategy, **options)
    first, models = outcome[members]
    view = peers[members].view
    assert view.epoch == 1 and view.members == tuple(range(members + 1)) and view.round == first
    assert 3 <= first < rounds
    donor = view.joins[members]
    assert donor in range(members)
    assert torch.equal(models[first - 1], outcome[donor][1][first - 1])  # the donor's state
    for rank in range(members):
        for round in range(first - 1, rounds):
            assert torch.equal(outcome[rank][1][round], models[round]), (rank, round)
        assert peers[rank].view == view
    if options.get("density", 1.0) < 1.0:
        return  # error feedback: not the exact mean (the joiner starts with no residual)
    # from the join on, the mean over every member, the joiner included
    torch.testing.assert_close(models[first] - models[first - 1], x[:, first].mean(dim=0),
                               rtol=1e-12, atol=1e-12)


class LateViews:
    """A loopback inbox that holds each due ``ctl.view`` until its owner has waited on it
    empty for ``late`` s after the view came: the view's connection is slower than the
    rounds' (different sockets on ZeroMQ, no order between them)."""

    def __init__(self, late: float):
        self.queue, self.late, self.held = queue.SimpleQueue(), late, []

    def put(self, frames):
        header = msgpack.unpackb(bytes(frames[0]))
        if header["kind"] == "ctl.view" and header["meta"].get("due"):
            self.held.append((time.monotonic() + self.late, frames))
        else:
            self.queue.put(frames)

    def get_nowait(self):
        return self.queue.get_nowait()

    def get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.queue.get(timeout=min(0.01, max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                for item in [h for h in self.held if h[0] <= time.monotonic()]:
                    self.held.remove(item)
                    self.queue.put(item[1])
                if time.monotonic() >= deadline:
                    raise


def test_a_join_view_that_reaches_a_member_late_is_held_before_its_round(local_topology,
                                                                         run_peers):
    """Rank 2 gets the join's view 0.5 s late, long after rounds take: the coordinator sends
    its input to the round before the view's only once every member holds it, so rank 2
    installs it in time (it started the view's round on the old one and was sent a message
    of the new epoch: "sent epoch=1, expected epoch=0")."""
    members, rounds = 4, 8
    topology = local_topology("ring", members + 1)
    hub = LoopbackHub(members + 1)
    hub.queues[2] = LateViews(0.5)
    outcome, peers, x = run_with_joins(run_peers, topology, members=members, rounds=rounds,
                                       joins={members: 2}, hub=hub)
    first, models = outcome[members]
    for rank in range(members):
        assert peers[rank].view == peers[members].view
        for round in range(first - 1, rounds):
            assert torch.equal(outcome[rank][1][round], models[round]), (rank, round)


@pytest.mark.parametrize("second, views", [(2, 2), (3, 3)], ids=["together", "apart"])
def test_two_joins_racing_give_one_view_each_or_one_with_both(second, views, local_topology,
                                                             run_peers):
    """Asks that reach the coordinator before it proposes share one view; one that comes
    while a join is pending gets the next view."""
    members, rounds = 4, 12
    topology = local_topology("ring", members + 2)
    outcome, peers, x = run_with_joins(run_peers, topology, members=members, rounds=rounds,
                                       joins={members: 2, members + 1: second})
    everyone = tuple(range(members + 2))
    for rank in everyone:
        assert peers[rank].view.members == everyone, (rank, peers[rank].view)
    installed: dict[int, set] = {}
    for rank in everyone:
        for view in peers[rank].transport.membership.epochs.history:
            installed.setdefault(view.epoch, set()).add((view.members, view.round))
    assert all(len(views) == 1 for views in installed.values()), installed
    assert len(installed) == views  # epoch 0, then one view with both or one each
    last = max(outcome[rank][0] for rank in everyone)
    for rank in everyone:
        for round in range(last, rounds):
            assert torch.equal(outcome[rank][1][round], outcome[0][1][round]), (rank, round)


def test_a_join_after_a_death(local_topology, run_peers):
    """Rank 2 dies after round 1; rank 4 joins later, asking the dead one too: the
    survivors' view admits it and all go on bitwise equal."""
    members, rounds = 4, 10
    topology = local_topology("ring", members + 1)
    outcome, peers, x = run_with_joins(run_peers, topology, members=members, rounds=rounds,
                                       joins={members: 3}, kills={2: 1})
    first, models = outcome[members]
    assert peers[members].view.members == (0, 1, 3, 4)
    for rank in (0, 1, 3):
        for round in range(first - 1, rounds):
            assert torch.equal(outcome[rank][1][round], models[round]), (rank, round)


@pytest.mark.parametrize("asks", [1, 3], ids=["activated-after-the-last", "in-the-last"])
def test_a_join_at_the_end_of_the_run_ends_cleanly(asks, local_topology, run_peers):
    """A join activated after the last round (proposed in round 2 of 4: round 4): the
    members close without it, the joiner got its state and runs no round. One asked in the
    last round: nobody admits it, and it sees the members go."""
    members, rounds = 3, 4
    topology = local_topology("ring", members + 1)
    outcome, peers, x = run_with_joins(run_peers, topology, members=members, rounds=rounds,
                                       joins={members: asks})
    for rank in range(members):
        assert sorted(outcome[rank][1]) == list(range(rounds))
        assert peers[rank].view.members == tuple(range(members))
    first, models = outcome[members]
    if asks == 1:
        assert first == rounds and torch.equal(models[rounds - 1], outcome[0][1][rounds - 1])
    else:
        assert (first, models) == (None, {})


def test_a_joiner_that_gives_up_after_the_members_ended_leaves_at_once(local_topology, caplog):
    """Started after the members ended (nothing listens at their addresses) and asked to
    leave: it awaits no goodbye from them (it waited the whole 10 s, logged)."""
    topology = local_topology("ring", 4)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="gossip.transport"):
        with Peer(3, topology, "ring-allreduce", timeout=TIMEOUT, dead_after=0.5, elastic=True,
                  spares=1) as peer:
            peer.request_leave()
            assert peer.enter() is None
    assert time.monotonic() - start < TIMEOUT / 2
    assert "no goodbye" not in caplog.text


def test_spares_need_elastic_and_only_spares_enter(local_topology):
    topology = local_topology("ring", 3)
    with pytest.raises(ConfigError, match="^spares must be"):
        Peer(0, topology, "ring-allreduce", spares=1)
    with pytest.raises(ConfigError, match="^spares must be"):
        Peer(0, topology, "ring-allreduce", elastic=True, spares=3)
    # a rendezvous takes spares: their ids go to peers joining through its store
    Peer(0, topology, "ring-allreduce", elastic=True, spares=1,
         rendezvous="file:///nonexistent/store")


@pytest.mark.slow
def test_launch_with_churn_one_join_one_leave_one_kill(tmp_path):
    """`gossip launch --churn` with P = 5: rank 5 joins at round 5 (once started), rank 3 leaves,
    rank 4 is killed -9;
    the launch exits 0 (the leave and the kill were scheduled), the others finish every
    round, all states equal in every round, the joiner's equal to its donor's before it
    ran, and membership.jsonl records the three events. 70 rounds of 0.15 s: the joiner's
    process has 10 s to start."""
    import json
    import re
    import subprocess
    import sys

    from gossip.metrics import read_jsonl

    rounds, leave, kill, run_dir = 70, 42, 56, tmp_path / "run"
    launch = subprocess.run(
        [sys.executable, "-m", "gossip", "launch", "--peers", "5", "--rounds", str(rounds),
         "--strategy", "ring-allreduce", "--elastic", "--churn",
         f"join@5,leave:3@{leave},kill:4@{kill}",
         "--run-dir", str(run_dir), "--timeout", "60", "--dead-after", "1",
         "--compute-delay", "0.15"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert launch.returncode == 0, (launch.stdout, launch.stderr)
    records = {r: {line["round"]: line for line in read_jsonl(run_dir / f"peer-{r}.jsonl")}
               for r in (0, 1, 2, 3, 4, 5)}
    for rank in (0, 1, 2):
        assert sorted(records[rank]) == list(range(rounds))
    # SIGTERM once it recorded `leave` rounds: it leaves after the round under way
    assert sorted(records[3]) == list(range(len(records[3])))
    assert leave + 1 <= len(records[3]) <= leave + 3
    assert kill <= len(records[4]) <= kill + 2 and 0 < len(records[5]) < rounds
    for round in range(rounds):
        assert len({rec[round]["state_hash"] for rec in records.values() if round in rec}) == 1
    joined = min(records[5])
    log = (run_dir / "peer-5.log").read_text()
    found = re.search(r"joined at round (\d+) from peer (\d+)'s state (\w+)", log)
    assert found and int(found[1]) == joined, log
    assert found[3] == records[int(found[2])][joined - 1]["state_hash"]
    events = [json.loads(line)["event"] for line in (run_dir / "membership.jsonl").open()]
    assert events == ["join", "leave", "kill"]
    assert records[0][rounds - 1]["epoch"] >= 3  # the join, the leave, the kill


@pytest.mark.slow
def test_launch_with_a_dpsgd_join_too_late_for_the_run_exits_0(tmp_path):
    """`gossip launch --churn join@27` of 30 rounds on dpsgd: the joiner's process starts
    (seconds) after the members closed, so nobody reads its ask; the launcher SIGTERMs it
    once the members ended, it gives up, exits 0 and records no round."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    launch = subprocess.run(
        [sys.executable, "-m", "gossip", "launch", "--peers", "5", "--rounds", "30",
         "--strategy", "dpsgd", "--elastic", "--churn", "join@27", "--run-dir", str(run_dir),
         "--timeout", "60", "--dead-after", "1", "--compute-delay", "0.15"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, (launch.stdout, launch.stderr)
    assert "1 join (peer 5 at round 27)" in launch.stdout
    records = run_dir / "peer-5.jsonl"
    assert not records.exists() or not records.read_text().strip()
