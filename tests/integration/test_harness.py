"""The run_peers helper itself: it must report failures and hangs, never hide them."""

from __future__ import annotations

import threading

import pytest


def test_results_come_back_by_rank(run_peers):
    assert run_peers(5, lambda rank: rank * rank) == [0, 1, 4, 9, 16]


def test_the_earliest_exception_is_raised_with_its_rank(run_peers):
    threads: dict[int, threading.Thread] = {}
    started = [threading.Event() for _ in range(3)]

    def fn(rank: int) -> None:
        threads[rank] = threading.current_thread()
        started[rank].set()
        if rank < 2:  # rank 2 raises first, then 1, then 0: each waits out the one above
            assert started[rank + 1].wait(5)
            threads[rank + 1].join(5)
        raise ValueError(f"from {rank}")

    with pytest.raises(ValueError, match="from 2") as info:
        run_peers(3, fn)
    assert "raised first, by rank 2 of 3" in "".join(info.value.__notes__)


def test_a_thread_still_running_fails_the_test(run_peers):
    release = threading.Event()
    try:
        with pytest.raises(pytest.fail.Exception, match="peer-1 did not finish within 0.2 s"):
            run_peers(2, lambda rank: rank == 1 and release.wait(5), timeout=0.2)
    finally:
        release.set()
