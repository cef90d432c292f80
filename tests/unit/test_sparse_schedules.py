"""The communication schedules of gtopk (binomial tree) and spardl (reverse Bruck reduce-scatter,
Bruck all-gather), simulated for every P up to 33: each contribution travels exactly one path,
step counts are ceil(log2 P), nothing is sent before everything it depends on has arrived."""

from __future__ import annotations

import math

import pytest

from gossip.strategies.sparse.gtopk import broadcast_steps, reduce_steps
from gossip.strategies.sparse.spardl import all_gather_schedule, reduce_scatter_schedule

SIZES = list(range(1, 34))


def levels(size: int) -> int:
    return math.ceil(math.log2(size)) if size > 1 else 0


@pytest.mark.parametrize("size", SIZES)
def test_gtopk_reduce_gives_every_set_one_chain_to_rank0(size):
    steps = {r: list(reduce_steps(r, size)) for r in range(size)}
    sends = {r: [(peer, lvl) for act, peer, lvl in s if act == "send"] for r, s in steps.items()}
    recvs = {(r, peer, lvl) for r, s in steps.items() for act, peer, lvl in s if act == "recv"}
    assert sends[0] == []
    for r in range(1, size):
        (parent, lvl), = sends[r]  # every other rank sends exactly once, as its last step
        assert steps[r][-1][0] == "send" and (parent, r, lvl) in recvs
        # ...and has merged all its children before (their levels are below its own).
        assert all(level < lvl for act, _, level in steps[r] if act == "recv")
    assert len(recvs) == size - 1
    # Count hops: every rank's set reaches rank 0 through one chain of at most log2 P merges.
    for r in range(size):
        hops, at = 0, r
        while at != 0:
            at, hops = sends[at][0][0], hops + 1
        assert hops <= levels(size)
    assert max((lvl for s in steps.values() for _, _, lvl in s), default=-1) == levels(size) - 1


@pytest.mark.parametrize("size", SIZES)
def test_gtopk_broadcast_reaches_everyone_once_in_log_steps(size):
    steps = {r: list(broadcast_steps(r, size)) for r in range(size)}
    has = {0}
    received = {r: 0 for r in range(size)}
    # Replay level by level: distances ceil(log2 P)-1 .. 0; a send needs the set first.
    for lvl in range(levels(size) - 1, -1, -1):
        d = 1 << lvl
        for r, s in steps.items():
            for act, peer in s:
                if act == "send" and peer - r == d:
                    assert r in has, f"rank {r} forwards before it has the set"
                    assert ("recv", r) in steps[peer]
                    has.add(peer)
                    received[peer] += 1
    assert has == set(range(size))
    assert all(received[r] == (r != 0) for r in range(size))


@pytest.mark.parametrize("size", SIZES)
def test_spardl_reduce_scatter_delivers_each_contribution_once(size):
    schedule = reduce_scatter_schedule(size)
    assert len(schedule) == levels(size)
    assert sum(m for _, m in schedule) == size - 1
    # contributions[r][b]: whose inputs peer r holds for block b; sent: blocks r sent.
    contributions = [{b: [r] for b in range(size)} for r in range(size)]
    sent = [set() for _ in range(size)]
    for d, m in schedule:
        messages = {}
        for r in range(size):
            blocks = [(r + d + j) % size for j in range(m)]
            assert not sent[r] & set(blocks), "a block is sent twice"
            assert r not in blocks, "the owner never sends its own block"
            sent[r] |= set(blocks)
            messages[(r + d) % size] = [(b, contributions[r][b]) for b in blocks]
            for b in blocks:
                contributions[r][b] = []
        for r, blocks in messages.items():
            assert [b for b, _ in blocks] == [(r + j) % size for j in range(m)]
            for b, who in blocks:
                assert b not in sent[r], "received a block after sending it on"
                contributions[r][b] += who
    for r in range(size):
        assert sent[r] == set(range(size)) - {r}
        assert sorted(contributions[r][r]) == list(range(size))


@pytest.mark.parametrize("size", SIZES)
def test_spardl_all_gather_gives_everyone_every_block_once(size):
    schedule = all_gather_schedule(size)
    assert len(schedule) == levels(size)
    assert sum(m for _, m in schedule) == size - 1
    have = [{r} for r in range(size)]
    for d, m in schedule:
        messages = {}
        for r in range(size):
            blocks = [(r + j) % size for j in range(m)]
            assert set(blocks) <= have[r], "forwards a block it does not have"
            messages[(r - d) % size] = blocks
        for r, blocks in messages.items():
            assert blocks == [(r + d + j) % size for j in range(m)]
            assert not have[r] & set(blocks), "a block arrives twice"
            have[r] |= set(blocks)
    assert all(h == set(range(size)) for h in have)


@pytest.mark.parametrize("size, expected", [(8, [(4, 4), (2, 2), (1, 1)]),
                                            (6, [(4, 2), (2, 2), (1, 1)]),
                                            (5, [(4, 1), (2, 2), (1, 1)]),
                                            (12, [(8, 4), (4, 4), (2, 2), (1, 1)]),
                                            (2, [(1, 1)]), (1, [])])
def test_spardl_schedule_matches_the_spec_examples(size, expected):
    assert reduce_scatter_schedule(size) == expected
