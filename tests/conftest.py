"""Shared fixtures: P peers as threads of the test process, topologies on free local ports,
strategy rounds over ZeroMQ or loopback, and the numpy/torch oracles their results must match.

Every helper opens Peers as context managers, so each test leaves no socket behind.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gossip.netutil import free_ports
from gossip.peer import Peer
from gossip.topology import Topology
from gossip.transport import LoopbackHub

# Tolerances of a float result against a float64 oracle.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
}


def run_in_threads(size: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list:
    """Run ``fn(rank)`` for every rank in its own thread and return the results by rank.

    Re-raises the earliest exception of any thread (noting its rank) once every thread has
    ended, and fails instead of hanging when a thread is still running after ``timeout``.
    """
    results: list[Any] = [None] * size
    errors: list[tuple[float, int, BaseException]] = []

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append((time.monotonic(), rank, exc))

    threads = [threading.Thread(target=main, args=(rank,), name=f"peer-{rank}", daemon=True)
               for rank in range(size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if errors:
        _, rank, exc = min(errors, key=lambda error: error[0])
        exc.add_note(f"(raised first, by rank {rank} of {size}"
                     + (f"; still running: {', '.join(stuck)})" if stuck else ")"))
        raise exc
    if stuck:
        pytest.fail(f"{', '.join(stuck)} did not finish within {timeout:g} s")
    return results


@pytest.fixture
def run_peers() -> Callable[..., list]:
    """``run_peers(P, fn, timeout=30)``: see run_in_threads."""
    return run_in_threads


def make_local_topology(kind: str, n: int | None = None, **params) -> Topology:
    """A generated topology (or, for a name like ``irregular-7``, the shipped file
    topologies/NAME.yaml) with every peer on 127.0.0.1 at a currently free port."""
    shipped = Path(__file__).parent.parent / "topologies" / f"{kind}.yaml"
    if shipped.exists():
        topology = Topology.from_yaml(shipped).relocated(host="127.0.0.1")
    else:
        topology = Topology.generate(kind, n, host="127.0.0.1", **params)
    return topology.relocated(ports=free_ports(topology.size))


@pytest.fixture
def local_topology() -> Callable[..., Topology]:
    """``local_topology(kind, n=None, **params)``: see make_local_topology."""
    return make_local_topology


def open_peer(rank: int, topology: Topology, strategy: str, *, hub: LoopbackHub | None = None,
              timeout: float = 10.0, **options) -> Peer:
    """A Peer over ZeroMQ, or over ``hub`` when given; use it as a context manager."""
    transport = hub.transport(rank, timeout=timeout) if hub is not None else None
    return Peer(rank, topology, strategy, timeout=timeout, transport=transport, **options)


@pytest.fixture(name="open_peer")
def open_peer_fixture() -> Callable[..., Peer]:
    """``open_peer(rank, topology, strategy, hub=None, timeout=10, **options)``."""
    return open_peer


@dataclass
class Rounds:
    """What ``run_rounds`` saw: ``results[round, rank]`` and each peer's final stats."""

    results: torch.Tensor
    stats: list[dict]


def run_rounds_on_peers(topology: Topology, strategy: str, data: torch.Tensor, *,
                        loopback: bool = False, inplace: bool = False, timeout: float = 10.0,
                        **options) -> Rounds:
    """Every peer synchronizes ``data[round, rank]`` (a fresh copy) for each round in turn.

    Peers start sending once all have bound their sockets (a connect to a socket not bound
    yet is retried only after ZeroMQ's 100 ms reconnect interval, which would dominate the
    run time); other tests cover peers starting in any order.
    With ``inplace`` the result is written into the input (``out=x``). Checks that each
    result has the input's shape and dtype (and storage, in place), and that once all peers
    closed cleanly every byte and message sent was received and none was rejected.
    """
    n_rounds, size = data.shape[:2]
    assert size == topology.size
    hub = LoopbackHub(size) if loopback else None
    results = torch.empty_like(data)
    stats: list[dict] = [{}] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        with open_peer(rank, topology, strategy, hub=hub, timeout=timeout, **options) as peer:
            all_bound.wait()
            for rnd in range(n_rounds):
                x = data[rnd, rank].clone()
                y = peer.synchronize(x, rnd, out=x if inplace else None)
                assert y.shape == x.shape and y.dtype == x.dtype
                if inplace:
                    assert y.data_ptr() == x.data_ptr(), "out=x did not write in place"
                results[rnd, rank] = y
        stats[rank] = peer.stats

    run_in_threads(size, peer_main, timeout=3 * timeout)
    assert_balanced(stats)
    return Rounds(results, stats)


@pytest.fixture
def run_rounds() -> Callable[..., Rounds]:
    """``run_rounds(topology, strategy, data, loopback=False, inplace=False, **options)``."""
    return run_rounds_on_peers


def iterate_on_peers(topology: Topology, strategy: str, x0: torch.Tensor, rounds: int, *,
                     loopback: bool = True, timeout: float = 10.0,
                     **options) -> tuple[torch.Tensor, list]:
    """Every peer feeds its result back in as its next input for ``rounds`` rounds,
    starting from ``x0[rank]``; returns the final ``x[rank]`` stacked and each peer's
    strategy (for its state, e.g. CHOCO's public copies)."""
    size = topology.size
    hub = LoopbackHub(size) if loopback else None
    final, strategies = [None] * size, [None] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        with open_peer(rank, topology, strategy, hub=hub, timeout=timeout, **options) as peer:
            all_bound.wait()
            x = x0[rank].clone()
            for rnd in range(rounds):
                x = peer.synchronize(x, rnd, out=x)
            final[rank], strategies[rank] = x, peer.strategy

    run_in_threads(size, peer_main, timeout=120)
    return torch.stack(final), strategies


@pytest.fixture
def iterate() -> Callable[..., tuple[torch.Tensor, list]]:
    """``iterate(topology, strategy, x0, rounds, loopback=True, **options)``."""
    return iterate_on_peers


def assert_balanced(stats: list[dict]) -> None:
    """After a clean shutdown of all peers, everything sent was received, nothing rejected."""
    total = {key: sum(s[key] for s in stats) for key in stats[0] if key != "by_kind"}
    assert total["bytes_sent"] == total["bytes_recv"], stats
    assert total["messages_sent"] == total["messages_recv"], stats
    assert total["messages_rejected"] == 0, stats


class Oracle:
    """Reference results computed in float64 with numpy, and the comparison with them."""

    @staticmethod
    def mean(data: torch.Tensor) -> torch.Tensor:
        """``data[round, rank, ...]`` -> ``mean over ranks`` per round, float64."""
        return torch.from_numpy(data.double().numpy().mean(axis=1))

    @staticmethod
    def mix(topology: Topology, data: torch.Tensor) -> torch.Tensor:
        """``(W @ X)[rank]`` per round for ``data[round, rank, n]``, float64."""
        return torch.from_numpy(np.einsum("ij,rjn->rin", topology.mixing_matrix(),
                                          data.double().numpy()))

    @staticmethod
    def matcha_active(plan, seed: int, round: int) -> list[int]:
        """The matchings active in ``round``, drawn as documented: ``default_rng([seed,
        round])``, one uniform per matching, active iff below its probability."""
        draws = np.random.default_rng([seed, round]).random(len(plan.matchings))
        return [j for j, p in enumerate(plan.probabilities) if draws[j] < p]

    @classmethod
    def matcha_mixing(cls, plan, seed: int, round: int) -> np.ndarray:
        """W(k) = I - alpha * sum of the active matchings' Laplacians, built pair by pair."""
        w = np.eye(plan.size)
        for j in cls.matcha_active(plan, seed, round):
            for a, b in plan.matchings[j]:
                w[a, b] = w[b, a] = plan.alpha
                w[a, a] -= plan.alpha
                w[b, b] -= plan.alpha
        return w

    @classmethod
    def matcha_partners(cls, plan, seed: int, round: int, rank: int) -> list[int]:
        """``rank``'s partners in ``round``, in matching order."""
        return [b if a == rank else a for j in cls.matcha_active(plan, seed, round)
                for a, b in plan.matchings[j] if rank in (a, b)]

    @classmethod
    def matcha_mix(cls, plan, seed: int, data: torch.Tensor) -> torch.Tensor:
        """``W(k) @ data[k]`` for every round k, float64; ``data[round, rank, ...]``."""
        flat = data.double().flatten(2).numpy()
        mixed = np.stack([cls.matcha_mixing(plan, seed, k) @ flat[k] for k in range(len(flat))])
        return torch.from_numpy(mixed).view(data.shape)

    @staticmethod
    def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(actual.double(), expected.double(),
                                   **TOLERANCE[actual.dtype])

    @classmethod
    def assert_mean_everywhere(cls, results: torch.Tensor, data: torch.Tensor) -> None:
        """``results[round, rank]`` is the mean over ranks of ``data[round]`` on every rank,
        and all ranks hold bitwise the same value."""
        cls.assert_close(results, cls.mean(data).unsqueeze(1).expand(results.shape))
        for rank in range(1, results.shape[1]):
            assert torch.equal(results[:, rank], results[:, 0]), f"rank {rank} differs"

    @classmethod
    def assert_mixed(cls, topology: Topology, results: torch.Tensor,
                     data: torch.Tensor) -> None:
        """``results[round, rank]`` is ``(W @ data[round])[rank]`` (any trailing shape)."""
        cls.assert_close(results.flatten(2), cls.mix(topology, data.flatten(2)))


@pytest.fixture
def oracle() -> type[Oracle]:
    return Oracle


def peer_data(n_rounds: int, size: int, shape: tuple[int, ...], dtype: torch.dtype,
              seed: int = 0) -> torch.Tensor:
    """Distinct random values per round and rank: ``[n_rounds, size, *shape]``."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn((n_rounds, size, *shape), generator=generator, dtype=torch.float64)
    return values.to(dtype)


@pytest.fixture
def make_data() -> Callable[..., torch.Tensor]:
    """``make_data(n_rounds, P, shape, dtype, seed=0)``: see peer_data."""
    return peer_data


# -- training steps -------------------------------------------------------------------


class TinyNet(torch.nn.Module):
    """Two layers plus a parameter the forward pass never uses (its grad stays None) and a
    frozen one (Peer.step must leave it out)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)
        self.unused = torch.nn.Parameter(torch.ones(2))
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(x) + self.frozen))


@dataclass
class Steps:
    """Flat trainable parameters and gradients per step and rank: ``[step, rank, d]``."""

    before: torch.Tensor
    grads: torch.Tensor
    after: torch.Tensor
    frozen_after: torch.Tensor  # [rank, 3]


def run_training_steps(topology: Topology, strategy: str, *, steps: int = 2, lr: float = 0.1,
                       same_init: bool = True, loopback: bool = False,
                       timeout: float = 10.0) -> Steps:
    """Each peer trains a TinyNet with SGD through ``Peer.step`` on its own batches."""
    size = topology.size
    hub = LoopbackHub(size) if loopback else None
    record: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(size)]
    frozen: list[torch.Tensor] = [torch.empty(0)] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        model = TinyNet()
        init = torch.Generator().manual_seed(0 if same_init else 100 + rank)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=init))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        trainable = [p for p in model.parameters() if p.requires_grad]
        batches = torch.Generator().manual_seed(1000 + rank)
        with open_peer(rank, topology, strategy, hub=hub, timeout=timeout) as peer:
            all_bound.wait()
            for _ in range(steps):
                inputs = torch.randn(5, 4, generator=batches)
                targets = torch.randn(5, 1, generator=batches)
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(inputs), targets).backward()
                before = flat(p.detach() for p in trainable)
                grads = flat(p.grad if p.grad is not None else torch.zeros_like(p)
                             for p in trainable)
                peer.step(model, optimizer)
                record[rank].append((before, grads, flat(p.detach() for p in trainable)))
        frozen[rank] = model.frozen.detach().clone()

    run_in_threads(size, peer_main, timeout=3 * timeout)

    def stack(i: int) -> torch.Tensor:  # -> [step, rank, d]
        return torch.stack([torch.stack([record[rank][s][i] for rank in range(size)])
                            for s in range(steps)])

    return Steps(stack(0), stack(1), stack(2), frozen_after=torch.stack(frozen))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).clone() for t in tensors])


@pytest.fixture
def train_steps() -> Callable[..., Steps]:
    """``train_steps(topology, strategy, steps=2, lr=0.1, same_init=True, loopback=False)``."""
    return run_training_steps


# -- rejections -----------------------------------------------------------------------


class Reasons(logging.Handler):
    """Every rejection reason rank 0 logs, in order, quiet repeats included."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "rejected message" in record.msg and record.args[0] == 0:
            self.reasons.append(record.args[1])

    def seen(self, pattern: str) -> bool:
        return any(re.search(pattern, reason) for reason in list(self.reasons))


@pytest.fixture
def reasons():
    """The rejection reasons rank 0's transport logs during the test."""
    handler, logger = Reasons(), logging.getLogger("gossip.transport")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)
