"""Joins through the rendezvous store: a peer started after the job began takes a fresh id
from the store's counter, publishes its address under the job's incarnation and asks the
members, who find it there; it is admitted as a spare is (one view per change, its donor's
state). Threads of this process under a fake torchrun: a TCPStore served by the test (the
agent's), keys of a dead earlier attempt left in it.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gossip.errors import RendezvousError
from gossip.peer import Peer
from gossip.ports import free_ports
from gossip.rendezvous import Rendezvous
from gossip.rendezvous.contact import Contact
from gossip.topology import Topology
from support.waiting import wait_until
from test_elastic_join import Killed, run_member

TIMEOUT = 10.0
RUN = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "sj",
       "MASTER_ADDR": "127.0.0.1"}


def agent_store(port: int):
    """The store torchrun's agent serves, holding what the job's first attempt (restart 0,
    dead) left: its join counter past every spare id, an address and a size for them."""
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=TIMEOUT),
                          wait_for_workers=False)
    old = "gossip/sj/0/"
    store.add(old + "joined", 5)
    store.set(old + "members", "9")
    for rank in range(12):
        store.set(f"{old}address/{rank}",
                  Contact("127.0.0.9", 9, "elsewhere", "x", "y").encode())
    return store


def run_store_joins(run_peers, *, members, spares, rounds, joins, kills=None,
                    strategy="ring-allreduce", **options):
    """Ranks < ``members`` start the job (env://, restart 1); ``joins`` of them each start a
    joiner once rank 0 completed the given round (``joins[i]``: the i-th joiner's), which
    takes its id from the store; rank 0 goes on only once the joiners due asked. ``kills``
    maps a member to the round after which it dies. Every peer runs
    ``model += synchronize(x)``, the joiner from its donor's model. Returns per thread
    (its id, first round, models by round) and each peer by id."""
    port = free_ports(1)[0]
    store = agent_store(port)
    env = {**RUN, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "1"}
    graph = Topology.from_dict({"graph": {"kind": "ring"}}, size=members + spares)
    x = torch.randn(members + spares, rounds, 23, generator=torch.Generator().manual_seed(7),
                    dtype=torch.float64)
    progress, done, kills = threading.Condition(), [-1], kills or {}
    peers: dict[int, Peer] = {}

    def main(thread: int):
        joiner = thread >= members
        # a joiner's own torchrun of one process: its RANK and WORLD_SIZE are not the job's
        launcher = {"RANK": "0", "WORLD_SIZE": "1"} if joiner else {
            "RANK": str(thread), "WORLD_SIZE": str(members)}
        rendezvous = Rendezvous.parse("env://", environ={**env, **launcher}, timeout=TIMEOUT)
        if joiner:
            with progress:
                assert progress.wait_for(lambda: done[0] >= joins[thread - members],
                                         timeout=TIMEOUT)
            rank = rendezvous.next_id(rendezvous.members(), spares)
        else:
            rank = rendezvous.rank_of()
        try:
            with Peer(rank, graph, strategy, rendezvous=rendezvous, timeout=TIMEOUT,
                      dead_after=0.5, elastic=True, spares=spares, **options) as peer:
                peers[rank] = peer
                return (rank, *run_member(peer, x[rank], rounds, joiner=joiner,
                                          dies=kills.get(rank), after_round=lambda round:
                                          rank == 0 and admit_asks(peer, round)))
        except Killed:
            return rank, None, None

    def admit_asks(peer, round):
        """As rank 0: go on once every joiner due by now asked (their ids are the store's)."""
        with progress:
            done[0] = round
            progress.notify_all()
        due, asked = sum(at <= round for at in joins), peer.transport.membership.epochs.asking
        wait_until(lambda: peer.transport.inbox.wait(0.01) and False
                   or len(asked | set(peer.view.members) - set(range(members))) >= due,
                   TIMEOUT, "the joiners' asks")

    try:
        return run_peers(members + len(joins), main, timeout=6 * TIMEOUT), peers, x
    finally:
        del store  # the agent's store serves until every peer is done


@pytest.mark.parametrize("strategy, options", [("ring-allreduce", {}),
                                               ("spardl", {"density": 1.0})])
def test_a_peer_joins_through_the_store_with_a_fresh_id(strategy, options, run_peers):
    """The joiner's id is the first after the members (the dead attempt's counter and
    addresses are never read); it is admitted with its donor's state and every member
    runs bitwise equal with it from then on."""
    members = 4
    outcome, peers, x = run_store_joins(run_peers, members=members, spares=2, rounds=8,
                                        joins=[2], strategy=strategy, **options)
    rank, first, models = outcome[members]
    assert rank == members
    view = peers[rank].view
    assert view.epoch == 1 and view.members == tuple(range(members + 1)) and view.round == first
    donor = view.joins[rank]
    assert torch.equal(models[first - 1], outcome[donor][2][first - 1])
    for member in range(members):
        assert peers[member].view == view
        for round in range(first - 1, 8):
            assert torch.equal(outcome[member][2][round], models[round]), (member, round)
    torch.testing.assert_close(models[first] - models[first - 1],
                               x[:members + 1, first].mean(dim=0), rtol=1e-12, atol=1e-12)


def one_view_per_epoch(peers, ids):
    installed: dict[int, set] = {}
    for rank in ids:
        for view in peers[rank].transport.membership.epochs.history:
            installed.setdefault(view.epoch, set()).add((view.members, view.round))
    assert all(len(views) == 1 for views in installed.values()), installed
    return installed


def test_two_joins_racing_through_the_store_take_two_ids_and_one_view_each_change(run_peers):
    """Two joiners started at once take ids 4 and 5 (never the same); the members agree on
    one view per epoch (both together, or one after the other), and all run bitwise equal
    once both are in."""
    members, rounds = 4, 10
    outcome, peers, x = run_store_joins(run_peers, members=members, spares=2, rounds=rounds,
                                        joins=[2, 2])
    assert sorted(outcome[t][0] for t in (members, members + 1)) == [4, 5]
    everyone = tuple(range(members + 2))
    installed = one_view_per_epoch(peers, everyone)
    assert 2 <= len(installed) <= 3
    last = max(outcome[t][1] for t in (members, members + 1))
    for t in range(members + 2):
        assert peers[outcome[t][0]].view.members == everyone
        for round in range(last, rounds):
            assert torch.equal(outcome[t][2][round], outcome[0][2][round]), (t, round)


def test_a_join_and_a_death_at_one_round_give_one_view_per_change(run_peers):
    """Rank 2 dies after round 2 while a joiner asks: every change gets one agreement (a
    number never names two views among the living), the joiner is admitted by the
    survivors, and all run bitwise equal."""
    members, rounds = 4, 10
    outcome, peers, x = run_store_joins(run_peers, members=members, spares=1, rounds=rounds,
                                        joins=[2], kills={2: 2})
    rank, first, models = outcome[members]
    alive = (0, 1, 3, rank)
    assert peers[rank].view.members == alive
    one_view_per_epoch(peers, alive)
    for member in (0, 1, 3):
        for round in range(first - 1, rounds):
            assert torch.equal(outcome[member][2][round], models[round]), (member, round)


def test_a_death_is_not_told_to_spare_ids_no_joiner_took(run_peers):
    """Ids nobody took have no address: the survivors tell only the members of a death (so
    none waits for a goodbye from them at the end), and go on bitwise equal."""
    outcome, peers, x = run_store_joins(run_peers, members=4, spares=2, rounds=5, joins=[],
                                        kills={2: 1})
    for rank in (0, 1, 3):
        assert not {4, 5} & peers[rank].transport.contacts, peers[rank].transport.contacts
        assert peers[rank].view.members == (0, 1, 3)
        assert torch.equal(outcome[rank][2][4], outcome[0][2][4])


def test_a_joiner_past_the_spare_ids_is_refused_in_one_line():
    port = free_ports(1)[0]
    store = agent_store(port)
    env = {**RUN, "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "1"}
    store.add("gossip/sj/1/joined", 2)
    with pytest.raises(RendezvousError) as info:
        Rendezvous.parse("env://", environ=env, timeout=2).next_id(4, 2)
    assert str(info.value) == ("rendezvous env://: no join id left: the job's 2 spare id(s) "
                               "(--spares) were all given")


@pytest.mark.slow
def test_gossip_peer_join_through_the_store(tmp_path):
    """`gossip peer --rendezvous tcp://... --join`: three members met through the store, a
    fourth process started later takes id 3 from it and joins; every peer exits 0, and every
    round's state hash is the same on every peer that ran it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from gossip.metrics import read_jsonl

    port, rounds = free_ports(1)[0], 40
    (tmp_path / "ring.yaml").write_text("graph: {kind: ring}\n")
    flags = ["--topology", str(tmp_path / "ring.yaml"), "--strategy", "ring-allreduce",
             "--elastic", "--spares", "1", "--rounds", str(rounds), "--compute-delay", "0.3",
             "--dead-after", "1", "--timeout", "60", "--quiet", "--run-dir", str(tmp_path)]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"}

    def peer(*args):
        return subprocess.Popen([sys.executable, "-m", "gossip", "peer", *args, *flags],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    members = [peer("--rendezvous", f"tcp://127.0.0.1:{port}?rank={r}&world_size=3")
               for r in range(3)]
    first = tmp_path / "peer-0.jsonl"
    deadline = time.monotonic() + 120
    while not (first.exists() and first.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the members' rounds are under way
    joiner = peer("--rendezvous", f"tcp://127.0.0.1:{port}", "--join")
    outputs = [proc.communicate(timeout=300)[0] for proc in [*members, joiner]]
    assert [proc.returncode for proc in [*members, joiner]] == [0] * 4, outputs
    records = {r: {line["round"]: line for line in read_jsonl(tmp_path / f"peer-{r}.jsonl")}
               for r in range(4)}
    assert 0 < min(records[3]) and max(records[3]) == rounds - 1
    for round in range(rounds):
        assert len({rec[round]["state_hash"] for rec in records.values() if round in rec}) == 1
