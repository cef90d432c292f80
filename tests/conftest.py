"""Fixtures over the helpers in tests/support (importable: ``from support import ...``), and
the leak check every test passes through."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

import support
from support import leaks


def pytest_configure(config):
    leaks.install()


def pytest_collection_modifyitems(items):
    """Under xdist (the README's ``-n 2 --dist loadgroup``) the slow tests, which start many
    peer processes each, run one after another on one worker while the other takes the
    rest: two of them at once on 2 cores would only stretch both towards their timeouts."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("slow"))


def pytest_collection_finish(session):
    """What exists once the tests are collected (torch, every test module) lives as long as
    the run: out of the collector's reach, each full collection walks only what the tests
    make (the unit tests spent 6.3 s of 120 s in it, 3.7 s so)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves threads, ZeroMQ contexts or child processes behind.

    Autouse fixtures are set up first and torn down last, so the check sees the test after
    every other fixture of it has cleaned up.
    """
    before = leaks.Leaks.start()
    yield
    problem = before.check()
    if problem:
        pytest.fail(f"{request.node.nodeid} left behind {problem}", pytrace=False)


@pytest.fixture
def run_peers() -> Callable[..., list]:
    """``run_peers(P, fn, timeout=30)``: see support.run_in_threads."""
    return support.run_in_threads


@pytest.fixture
def local_topology() -> Callable[..., support.peers.Topology]:
    """``local_topology(kind, n=None, **params)``: see support.make_local_topology."""
    return support.make_local_topology


@pytest.fixture(name="open_peer")
def open_peer_fixture() -> Callable[..., support.peers.Peer]:
    """``open_peer(rank, topology, strategy, hub=None, timeout=10, **options)``."""
    return support.open_peer


@pytest.fixture
def run_rounds() -> Callable[..., support.Rounds]:
    """``run_rounds(topology, strategy, data, loopback=False, inplace=False, **options)``."""
    return support.run_rounds_on_peers


@pytest.fixture
def iterate() -> Callable[..., tuple[torch.Tensor, list]]:
    """``iterate(topology, strategy, x0, rounds, loopback=True, **options)``."""
    return support.iterate_on_peers


@pytest.fixture
def oracle() -> type[support.Oracle]:
    return support.Oracle


@pytest.fixture
def make_data() -> Callable[..., torch.Tensor]:
    """``make_data(n_rounds, P, shape, dtype, seed=0)``: see support.peer_data."""
    return support.peer_data


@pytest.fixture
def train_steps() -> Callable[..., support.Steps]:
    """``train_steps(topology, strategy, steps=2, lr=0.1, same_init=True, loopback=False)``."""
    return support.run_training_steps


@pytest.fixture
def reasons():
    """The rejection reasons rank 0's transport logs during the test."""
    with support.rejection_reasons() as handler:
        yield handler
