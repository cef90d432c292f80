"""The run_peers helper itself: it must report failures and hangs, never hide them."""

from __future__ import annotations

import threading
import time

import pytest


def test_results_come_back_by_rank(run_peers):
    assert run_peers(5, lambda rank: rank * rank) == [0, 1, 4, 9, 16]


def test_the_earliest_exception_is_raised_with_its_rank(run_peers):
    def fn(rank: int) -> None:
        time.sleep(0.05 * (2 - rank))
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
