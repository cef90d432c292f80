"""The soak benchmark's bookkeeping on a short real run (the long one is not a unit test)."""

from __future__ import annotations

import pytest

from gossip.bench.soak import process_usage, report, soak


def test_process_usage_counts_this_process():
    usage = process_usage()
    assert usage["rss"] > 10 << 20 and usage["threads"] >= 1 and usage["fds"] >= 3


@pytest.mark.slow  # spawns peer processes
def test_short_soak_reports_no_leak_and_flags_one():
    results = soak(3, 1000, 40, warmup=10, timeout=120)
    lines = []
    assert report(results, 40, 10, echo=lines.append), lines
    assert all(r["end"]["sockets"] == r["start"]["sockets"] for r in results)
    leaky = [dict(r, end=dict(r["end"], sockets=r["end"]["sockets"] + 1)) for r in results]
    assert not report(leaky, 40, 10, echo=lines.append)
    assert "NOT met" in lines[-1]
