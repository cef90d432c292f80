"""The compatibility matrix walked cell by cell (generated from gossip/matrix.py: a new
strategy, wrapper inner or mode joins with no edit here, and a mode with no run below
fails). A "works" cell trains three peers (threads; loopback queues, or ZeroMQ where the mode
needs sockets) for two rounds of the digits task and is checked against the same row
without the mode where that is defined (a lockstep strategy gives the same losses simulated,
met through a rendezvous, on a shared device and with checkpoints; an exact mean the same
with overlap). A refused cell must be refused by the mode's own entry, in one line."""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import pytest
import torch

from gossip import matrix
from gossip.config import TrainConfig
from gossip.crossover.local import LocalArbiter
from gossip.crossover.trainer import DeviceTrainer
from gossip.errors import ConfigError
from gossip.ports import free_ports
from gossip.peer import Peer
from gossip.rendezvous import Rendezvous
from gossip.sim import simulate_run
from gossip.strategies import STRATEGIES
from gossip.topology import Topology
from gossip.training.synchronous import train
from gossip.transport import LoopbackHub

from support import run_in_threads

SIZE, ROUNDS, TIMEOUT = 3, 2, 30.0
ROWS = matrix.rows()
FEATURES = matrix.features()


def config(row: matrix.Row, **changes) -> TrainConfig:
    return TrainConfig(**{"strategy": row.strategy, "options": dict(row.options),
                          "rounds": ROUNDS, "batch_size": 8, "eval_every": ROUNDS, "seed": 1,
                          "timeout": TIMEOUT, "snapshot_seconds": 0.0, **changes})


def lockstep(row: matrix.Row) -> bool:
    """Whether the row's results do not depend on timing: lockstep rounds that end where
    the batch does (nonblocking's end where the first peer's STOP arrives)."""
    held = matrix.capabilities(row.strategy, row.options)
    return held["synchronous"] and not held["stops_rounds_early"]


def run(row: matrix.Row, cfg: TrainConfig | None = None, *, topology: Topology | None = None,
        rendezvous: bool = False, trainer=None, **train_args) -> list[list[dict]]:
    """Every rank's records of ``cfg`` (default ``config(row)``); ranks that only serve
    (topology roles) serve and have none. ``trainer(rank)``: a context manager giving
    ``train``'s make_trainer."""
    cfg = cfg or config(row)
    topology = topology or Topology.generate("ring", SIZE)
    hub = None if rendezvous else LoopbackHub(SIZE)
    port = free_ports(1)[0]
    records: list[list[dict]] = [[] for _ in range(SIZE)]

    def main(rank: int) -> None:
        transport, meet = None, None
        if hub is not None:
            transport = hub.transport(rank, timeout=TIMEOUT)
        else:
            env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(SIZE)}
            meet = Rendezvous.parse(f"tcp://127.0.0.1:{port}", environ=env, timeout=TIMEOUT)
        with Peer(rank, topology, cfg.strategy, timeout=TIMEOUT, transport=transport,
                  rendezvous=meet, keep_for_rejoin=cfg.checkpoint_every > 0,
                  elastic=cfg.elastic, **cfg.options) as peer:
            if topology.roles is not None and rank not in topology.roles.workers:
                peer.serve()
                return
            extra = {k: (v(rank) if callable(v) else v) for k, v in train_args.items()}
            if trainer is None:
                train(peer, cfg, on_round=records[rank].append, **extra)
                return
            with trainer(rank) as make_trainer:
                train(peer, cfg, on_round=records[rank].append, make_trainer=make_trainer,
                      **extra)

    run_in_threads(SIZE, main, timeout=4 * TIMEOUT)
    return records


_BASELINES: dict[str, list[list[dict]]] = {}


def baseline(row: matrix.Row) -> list[list[dict]]:
    """The row with no mode: its records (run once per row), checked sane."""
    if row.label not in _BASELINES:
        records = run(row)
        assert_trained(records)
        _BASELINES[row.label] = records
    return _BASELINES[row.label]


def assert_trained(records: list[list[dict]], ranks=range(SIZE), rounds: int = ROUNDS) -> None:
    for rank in ranks:
        assert [line["round"] for line in records[rank]] == list(range(rounds)), rank
        assert all(math.isfinite(line["loss"]) for line in records[rank]  # None: stopped
                   if line["minibatches"]), records[rank]                  # before any


def assert_same_losses(ours: list[list[dict]], theirs: list[list[dict]]) -> None:
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close([line["loss"] for line in a], [line["loss"] for line in b],
                                   rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


def servers_topology() -> Topology:
    return Topology.from_dict({"size": SIZE, "base_port": 1, "servers": [0]})


# -- each mode: its run (a "works" cell) and its entry (a refused one) ----------------------
def works_overlap(row, tmp_path):
    records = run(row, config(row, overlap=True))
    assert_trained(records)
    assert all(line["buckets"] >= 1 for lines in records for line in lines)  # attached
    if matrix.capabilities(row.strategy, row.options)["exact_mean"]:
        assert_same_losses(records, baseline(row))  # one bucket: the blocking step's sums


def works_simulate(row, tmp_path):
    result = simulate_run(config(row), Topology.generate("ring", SIZE), tmp_path, write=False)
    assert result.failed == {}
    records = [result.records[rank] for rank in range(SIZE)]
    assert_trained(records)
    if lockstep(row):
        assert_same_losses(records, baseline(row))


def works_roles(row, tmp_path):
    records = run(row, topology=servers_topology())
    assert_trained(records, ranks=(1, 2))
    assert records[0] == []


def works_rendezvous(row, tmp_path):
    records = run(row, rendezvous=True)
    assert_trained(records)
    if lockstep(row):
        assert_same_losses(records, baseline(row))


def works_budgets(row, tmp_path):
    records = run(row, config(row, rounds=2 * ROUNDS, budget_samples=8 * ROUNDS))
    assert_trained(records)  # stopped by the budget, not the rounds


def works_arbiter(row, tmp_path):
    arbiter = LocalArbiter()

    @contextlib.contextmanager
    def device(rank):
        lock = arbiter.lock(f"dev{rank}", "job", rank, timeout=TIMEOUT)
        try:
            yield functools.partial(DeviceTrainer, device=lock)
        finally:
            lock.close()

    records = run(row, trainer=device)
    assert_trained(records)
    assert all(line["device_hold_s"] >= 0 for lines in records for line in lines)  # turns
    if lockstep(row):
        assert_same_losses(records, baseline(row))


def works_checkpoint(row, tmp_path):
    path = lambda rank: tmp_path / f"peer-{rank}.pt"  # noqa: E731
    records = run(row, config(row, checkpoint_every=1), checkpoint_path=path)
    assert_trained(records)
    if lockstep(row):
        assert_same_losses(records, baseline(row))
    resumed = run(row, config(row, rounds=ROUNDS + 1, checkpoint_every=1), checkpoint_path=path,
                  resume=True, history=lambda rank: records[rank])
    for rank in range(SIZE):  # the whole job resumed at its last checkpoint's next round
        assert resumed[rank][0]["round"] == ROUNDS and "resumed_from" in resumed[rank][0]
        last = resumed[rank][-1]
        assert not last["minibatches"] or math.isfinite(last["loss"])


def works_cuda(row, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hub = LoopbackHub(SIZE)
    x = torch.randn(SIZE, 10, generator=torch.Generator().manual_seed(0))

    def main(rank):
        with Peer(rank, Topology.generate("ring", SIZE), row.strategy,
                  transport=hub.transport(rank, timeout=TIMEOUT), **row.options) as peer:
            on_host = peer.synchronize(x[rank].clone(), 0)
            on_device = peer.synchronize(x[rank].cuda(), 1)
            return on_host, on_device.cpu()

    results = run_in_threads(SIZE, main, timeout=4 * TIMEOUT)
    for on_host, on_device in results:
        assert on_device.shape == on_host.shape and torch.isfinite(on_device).all()


def works_elastic(row, tmp_path):
    records = run(row, config(row, elastic=True))
    assert_trained(records)
    assert_same_losses(records, baseline(row))  # no death: the same rounds


def works_wrapped(row, feature, tmp_path):
    wrapped = matrix.Row(feature.wrapper, {"inner": row.strategy,
                                           "inner_options": dict(row.options) or None})
    assert_trained(run(wrapped))


def refused_by_entry(row: matrix.Row, feature: matrix.Feature) -> str:
    """The one-line error of the entry a user meets the cell through."""
    entries = {
        "overlap": lambda: config(row, overlap=True),
        "budgets": lambda: config(row, budget_samples=8),
        "checkpoint": lambda: config(row, checkpoint_every=1),
        "roles": lambda: Peer(1, servers_topology(), row.strategy, **row.options),
        "simulate": lambda: simulate_run(config(row), Topology.generate("ring", SIZE),
                                         "unused", write=False),
        "arbiter": lambda: matrix.check_run(config(row), arbiter=True),  # gossip peer/launch
        "elastic": lambda: config(row, elastic=True),
    }
    if feature.wrapper:
        entry = lambda: STRATEGIES.options(feature.wrapper, {  # noqa: E731
            "inner": row.strategy, "inner_options": dict(row.options) or None})
    else:
        entry = entries.get(feature.name)
        assert entry is not None, f"no entry for a refused {feature.name} cell: add one"
    with pytest.raises(ConfigError) as info:
        entry()
    assert "\n" not in str(info.value)
    return str(info.value)


WORKS = {"overlap": works_overlap, "simulate": works_simulate, "roles": works_roles,
         "rendezvous": works_rendezvous, "budgets": works_budgets, "arbiter": works_arbiter,
         "checkpoint": works_checkpoint, "cuda": works_cuda, "elastic": works_elastic}


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.label)
@pytest.mark.parametrize("feature", FEATURES, ids=lambda feature: feature.name)
def test_cell(row: matrix.Row, feature: matrix.Feature, tmp_path: Path):
    why = matrix.cell(row, feature)
    if why is not None:
        assert why in refused_by_entry(row, feature)
        return
    if feature.wrapper:
        works_wrapped(row, feature, tmp_path)
        return
    works = WORKS.get(feature.name)
    assert works is not None, f"no run for the mode {feature.name}: add one to WORKS"
    works(row, tmp_path)


def test_every_row_trains_without_any_mode():
    for row in ROWS:
        baseline(row)



def test_a_simulated_asynchronous_run_stops_at_its_budget():
    """Two modes at once: the simulator ran every strategy's rounds in lockstep, so an
    asynchronous one trained all its rounds, whatever its budget."""
    row = matrix.Row("adpsgd", {})
    result = simulate_run(config(row, rounds=3 * ROUNDS, budget_samples=8 * ROUNDS),
                          Topology.generate("ring", SIZE), "unused", write=False)
    assert result.failed == {}
    assert_trained([result.records[rank] for rank in range(SIZE)])


def test_a_simulated_parameter_server_rank_serves():
    """Two modes at once: the simulator trained every rank, so a rank of servers: raised
    ("a server only") and its workers failed with the shard lost."""
    result = simulate_run(config(matrix.Row("ps", {})), servers_topology(), "unused", write=False)
    assert result.failed == {}
    assert result.records[0] == []
    assert_trained([result.records[rank] for rank in range(SIZE)], ranks=(1, 2))
