"""Sparse sets and their arithmetic for the sparse all-reduce strategies.

A sparse set is a pair of numpy arrays: strictly increasing int64 indices and their values
(in the tensor's dtype). Exact zeros are never sent: they carry no mass, and gradients of
ReLU networks hold many of them.
"""

from __future__ import annotations

import numpy as np
import torch

from gossip.compress.selection import sample_size_for, topk_select

_EMPTY_IDX = np.zeros(0, dtype=np.int64)


def select(x: torch.Tensor, k: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sorted indices of the ``k`` largest ``|x|`` (exact) and ``x`` there, zeros left out.

    The values are a copy: ``x`` may be modified afterwards.
    """
    idx, val = topk_select(x, k, generator=generator, sample_size=sample_size_for(x.numel()))
    idx, val = idx.numpy(), val.numpy()
    nonzero = val != 0
    if not nonzero.all():
        idx, val = idx[nonzero], val[nonzero]
    return idx, val


def member(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Mask over sorted, distinct ``a``: which of its elements are in sorted, distinct ``b``."""
    mask = np.zeros(a.size, dtype=bool)
    if a.size and b.size:
        both, order = _merged(a, b)
        # A common element appears twice in a row, a's copy first (the sort is stable).
        mask[order[np.flatnonzero(both[1:] == both[:-1])]] = True
    return mask


def merge_sum(ai: np.ndarray, av: np.ndarray, bi: np.ndarray,
              bv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of two sparse sets, values summed (a + b) where indices coincide; new arrays."""
    idx, order = _merged(ai, bi)
    val = np.concatenate([av, bv])[order]
    first = np.flatnonzero(idx[1:] == idx[:-1])  # a's entry; b's follows it
    if not first.size:
        return idx, val
    val[first] += val[first + 1]
    keep = np.ones(idx.size, dtype=bool)
    keep[first + 1] = False
    return idx[keep], val[keep]


def _merged(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a`` and ``b`` (each sorted) merged, and where each element came from (< a.size: a).

    A stable sort of two sorted runs is one linear merge (timsort finds the runs): several
    times faster than a binary search of one in the other.
    """
    both = np.concatenate([a, b])
    order = np.argsort(both, kind="stable")
    return both[order], order


def keep_topk(idx: np.ndarray, val: np.ndarray,
              k: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Split a sparse set into its ``k`` entries of largest ``|val|`` (zeros left out) and
    the rest; both parts stay sorted by index."""
    if idx.size > k:
        mag = np.abs(val)
        kth = np.partition(mag, idx.size - k)[idx.size - k]
        keep = mag >= kth if kth > 0 else mag > 0
        if np.count_nonzero(keep) > k:  # ties at the k-th magnitude: pick k of them
            keep = np.zeros(idx.size, dtype=bool)
            keep[np.argpartition(mag, idx.size - k)[idx.size - k:]] = True
            keep &= mag > 0
    else:
        keep = val != 0
        if keep.all():
            return (idx, val), (_EMPTY_IDX, val[:0])
    drop = ~keep
    return (idx[keep], val[keep]), (idx[drop], val[drop])
