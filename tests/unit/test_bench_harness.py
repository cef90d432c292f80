"""Tests for the multi-process benchmark harness and the communication baselines."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

import gossip

from gossip.bench.harness import format_table, run_ranks, summarize
from gossip.errors import BenchmarkFailed, ConfigError

# Targets must be module-level so the spawned ranks can import them by name. This
# module imports only the harness at top level (baselines pulls in torch), so ranks
# started by the harness-only tests stay cheap.


def _echo(rank, world, tag):
    return (rank, world, tag, os.environ.get("OMP_NUM_THREADS"))


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom from rank one")
    time.sleep(3600)  # the harness must terminate the survivors


def _hang_on_two(rank, world):
    if rank == 2:
        time.sleep(3600)  # hangs: the harness must time it out
    return rank


def _hang_ignoring_sigterm(rank, world):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank >= 2:
        time.sleep(3600)  # hangs, deaf to SIGTERM: the harness must kill it
    return rank


def _die_silently(rank, world):
    os._exit(3)


def _assert_no_children():
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("world", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_run_ranks_returns_results_in_rank_order(world):
    results = run_ranks(_echo, world, "x", timeout=60)
    assert results == [(r, world, "x", "1") for r in range(world)]
    _assert_no_children()


def test_run_ranks_env_overrides_defaults_and_restores_parent_env():
    before = dict(os.environ)
    (result,) = run_ranks(_echo, 1, "y", timeout=60, env={"OMP_NUM_THREADS": "2"})
    assert result[3] == "2"
    assert dict(os.environ) == before


def test_run_ranks_reports_failing_rank_and_cleans_up():
    start = time.monotonic()
    with pytest.raises(BenchmarkFailed) as info:
        run_ranks(_fail_on_one, 3, timeout=60)
    message = str(info.value)
    first_line = message.splitlines()[0]
    assert "rank 1" in first_line
    assert "ValueError: boom from rank one" in first_line
    assert "Traceback" in message  # the rank's traceback follows the summary
    assert time.monotonic() - start < 100  # survivors were terminated, not waited for
    _assert_no_children()


# The timeout counts from the first start, before a spawned rank has even imported this
# module: on a loaded machine the ranks that return at once may still be missing then too.
MISSING = r"rank\(s\) (0, )?(1, )?"


@pytest.mark.slow  # waits out its 3 s timeout
def test_run_ranks_timeout_names_missing_ranks_and_cleans_up():
    with pytest.raises(BenchmarkFailed, match=MISSING + r"2 did not finish within 3 s"):
        run_ranks(_hang_on_two, 3, timeout=3)
    _assert_no_children()


@pytest.mark.slow  # waits out its timeout and the terminate grace
def test_run_ranks_kills_ranks_that_ignore_sigterm():
    with pytest.raises(BenchmarkFailed, match=MISSING + r"2, 3 did not finish within 3 s"):
        run_ranks(_hang_ignoring_sigterm, 4, timeout=3)
    _assert_no_children()


@pytest.mark.slow
def test_run_ranks_detects_rank_that_exits_without_result():
    with pytest.raises(BenchmarkFailed, match="exited with code 3"):
        run_ranks(_die_silently, 1, timeout=30)
    _assert_no_children()


def test_run_ranks_rejects_empty_world():
    with pytest.raises(ConfigError):
        run_ranks(_echo, 0, "x")


def test_summarize():
    assert summarize([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    with pytest.raises(ConfigError):
        summarize([])


def test_format_table_aligns_columns():
    rows = [{"name": "gloo", "ms": 1.23456}, {"name": "zmq-ring", "ms": 12.5, "n": 5}]
    lines = format_table(rows, ["name", "ms", "n"]).splitlines()
    assert lines[0].split() == ["name", "ms", "n"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["gloo", "1.235"]
    assert lines[3].split() == ["zmq-ring", "12.5", "5"]
    # Numbers are right-aligned: the "ms" column ends at the same offset.
    assert lines[2].index("1.235") + len("1.235") == lines[3].index("12.5") + len("12.5")


def test_ring_neighbors():
    from gossip.bench.baselines import ring_neighbors

    assert ring_neighbors(0, 1) == ()
    assert ring_neighbors(0, 2) == (1,)
    assert ring_neighbors(1, 2) == (0,)
    assert ring_neighbors(0, 4) == (1, 3)
    assert ring_neighbors(3, 4) == (0, 2)


def test_zmq_exchange_rejects_asymmetric_graph():
    from gossip.bench.baselines import zmq_exchange_times

    with pytest.raises(ConfigError, match="symmetric"):
        zmq_exchange_times(3, 10, neighbors=lambda r, w: ((r + 1) % w,))


@pytest.mark.slow  # spawns ranks that import torch
def test_gloo_allreduce_times():
    from gossip.bench.baselines import gloo_allreduce_times

    times = gloo_allreduce_times(world=2, numel=1000, reps=2, timeout=120)
    assert len(times) == 2
    assert all(isinstance(t, float) and t > 0 for t in times)
    _assert_no_children()


@pytest.mark.slow  # spawns ranks that import torch
def test_zmq_exchange_times():
    from gossip.bench.baselines import zmq_exchange_times

    times = zmq_exchange_times(world=3, numel=1000, reps=2, timeout=120)
    assert len(times) == 2
    assert all(isinstance(t, float) and t > 0 for t in times)
    _assert_no_children()


def test_a_benchmark_failure_is_a_gossip_error_and_still_a_runtime_error():
    with pytest.raises(gossip.GossipError) as info:
        run_ranks(_fail_on_one, 2, timeout=60)
    assert isinstance(info.value, gossip.BenchmarkFailed) and isinstance(info.value, RuntimeError)
    _assert_no_children()
