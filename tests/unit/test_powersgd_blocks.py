"""Which tensors PowerSGD compresses (gossip/strategies/ring/lowrank.py): the element counts
on the wire for ResNet-18 (CIFAR form) are those computed in shared/specs/workloads.md §1."""

from __future__ import annotations

import math

import pytest

from gossip.strategies.ring.lowrank import blocks


def resnet18_shapes() -> list[tuple[int, ...]]:
    """3x3 stem of 64, four stages of two BasicBlocks (a 1x1 shortcut entering stages 2-4),
    batch norms, FC 10: 11,173,962 parameters."""
    shapes = [(64, 3, 3, 3), (64,), (64,)]
    cin = 64
    for stage, c in enumerate((64, 128, 256, 512)):
        for block in range(2):
            shapes += [(c, cin, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if stage and not block:
                shapes += [(c, cin, 1, 1), (c,), (c,)]
            cin = c
    return shapes + [(10, 512), (10,)]


@pytest.mark.parametrize("rank, elements", [(1, 45_935), (2, 82_260), (4, 154_910)])
def test_resnet18_sends_the_computed_elements(rank, elements):
    shapes = resnet18_shapes()
    numel = sum(math.prod(s) for s in shapes)
    assert numel == 11_173_962
    layout = blocks(shapes, numel, rank=rank, min_compression_rate=2.0)
    sent = sum(b.rank * (b.rows + b.cols) if b.rank else b.stop - b.start for b in layout)
    assert sent == elements
    conv = layout[0]  # a conv kernel is (out, in*kh*kw)
    assert (conv.rows, conv.cols) == (64, 27)


def test_vectors_scalars_and_small_matrices_go_dense():
    layout = blocks([(5,), (), (3, 4), (40, 50)], 5 + 1 + 12 + 2000, rank=2,
                    min_compression_rate=2.0)
    assert [b.rank for b in layout] == [0, 0, 0, 2]  # 2*2*(3+4) = 28 >= 12
    everything = blocks([(3, 4)], 12, rank=9, min_compression_rate=0.0)
    assert everything[0].rank == 3  # r = min(rank, n, m)
