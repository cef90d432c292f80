"""Index selection: the exact top-k by magnitude (fast path by sampling) and |x| >= t scans.

The sampled top-k is exact by construction: a threshold taken from a random sample keeps a
candidate set a little larger than k, every element outside it is smaller than every element
inside, and the exact top-k of the candidates is the top-k of all. If the sample was unlucky
and fewer than k candidates pass, the full ``torch.topk`` runs instead.

Ties are broken one way on every path: of the entries whose magnitude equals the k-th
largest, the lowest indices are kept. Both paths find the k-th magnitude (a partition of the
candidates, or ``torch.topk``), keep everything above it and the first ties in index order,
so the sampled and the exact method return the same indices and values, bit for bit, also
on tensors full of equal values (fp16 models, zeros).

Why numpy for the scan: the compare + nonzero over the whole tensor dominates, and numpy does
it single-threaded in cache-sized chunks about 5x faster than torch's ``abs``/``ge``/``nonzero``
chain on our small shared CPUs (no 100 MB temporaries, no thread-pool wake-ups).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator

import numpy as np
import torch

#: Elements drawn (with replacement) to estimate the threshold.
SAMPLE_SIZE = 1 << 17
#: Standard deviations of the sampled fraction the threshold is lowered by; at 4 the
#: candidate set is too small (full fallback) about once in 30,000 calls.
MARGIN_SIGMAS = 4.0
#: Bits of a magnitude (after the sign) that pick its bucket in ``_order_statistic``.
_BUCKET_BITS = 16
#: Candidates from which ``_kth_largest`` takes the buckets rather than one partition.
_BUCKETS_FROM = 1 << 15
_UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Elements per chunk of the numpy scan: 1 MiB of float32 stays in cache.
_CHUNK = 1 << 18
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
#: Where numpy's subtraction rounds as torch's does (float16 goes through float32 in both,
#: but not provably alike): the fused difference is taken only for these.
_FUSED_DTYPES = (torch.float32, torch.float64)


#: The most ``sample_size_for`` draws: each draw is a cache miss (~15 ns at 25M floats), and
#: 32k of them set the candidates ~20% above k at 1% (131k: ~11%, 3 ms more to draw).
LARGE_SAMPLE = 1 << 15


class _Scratch(threading.local):
    """Chunk-sized buffers of the scans, kept per thread: a fresh 1 MiB array is mapped anew
    and page-faults on every call (at 1M floats that was 1 of the scan's 1.7 ms)."""

    def __init__(self):
        self.buffers: dict[tuple[str, np.dtype], np.ndarray] = {}

    def get(self, name: str, size: int, dtype) -> np.ndarray:
        key = (name, np.dtype(dtype))
        buffer = self.buffers.get(key)
        if buffer is None or buffer.size < size:
            buffer = self.buffers[key] = np.empty(max(size, 1), dtype=dtype)
        return buffer[:size]


_scratch = _Scratch()


def sample_size_for(n: int) -> int:
    """A sample of n/128, at most ``LARGE_SAMPLE``, places the threshold well enough (at 1%:
    ~60% more candidates than k at 1M, ~20% from 4M); the full default costs more than the
    scan itself on tensors of a few million."""
    return min(LARGE_SAMPLE, max(4096, n // 128))


def topk_indices(x: torch.Tensor, k: int, *, method: str = "sampled",
                 generator: torch.Generator | None = None,
                 sample_size: int = SAMPLE_SIZE) -> torch.Tensor:
    """Sorted int64 indices of exactly ``k`` entries of largest ``|x|`` (1-D ``x``).

    Args:
        x: A contiguous 1-D float tensor.
        k: How many to select; clamped to [0, numel].
        method: ``"exact"`` (torch.topk over everything) or ``"sampled"`` (candidates above a
            sampled threshold, then the exact top-k of those; same result).
        generator: Source of the sample positions (a fresh unseeded one if None).
        sample_size: Sample drawn by the sampled method; inputs smaller than 4x this, or
            with k above a quarter of them, use the exact method (it is as fast there).
    """
    return topk_select(x, k, method=method, generator=generator, sample_size=sample_size)[0]


def topk_select(x: torch.Tensor, k: int, *, method: str = "sampled",
                generator: torch.Generator | None = None,
                sample_size: int = SAMPLE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_indices`` and the selected entries ``x[indices]`` (gathered once)."""
    n = x.numel()
    k = max(0, min(k, n))
    if k == n:
        return torch.arange(n), x.clone()
    if k == 0 or method == "exact" or n < 4 * sample_size or 4 * k > n:
        idx = _exact(x, k)
        return idx, x[idx]
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES:
        return _sampled_torch(x, k, generator, sample_size)
    a = x.numpy()
    positions = torch.randint(n, (sample_size,), generator=generator).numpy()
    threshold = _threshold(np.abs(a[positions]), k / n)
    return _keep_k(x, k, *_scan_values(_chunks(a), threshold))


def topk_select_difference(x: torch.Tensor, base: torch.Tensor, out: torch.Tensor, k: int, *,
                           method: str = "sampled", generator: torch.Generator | None = None,
                           sample_size: int = SAMPLE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_select(x - base)``, the same bits, with ``out`` (x's shape and dtype) as room for
    the difference: where it can, the sampled method takes each chunk of the difference into
    a chunk-sized scratch and scans it while it is in cache, gathering the candidates' values
    there (one read of ``x`` and ``base``, nothing model-sized written), and fills ``out``
    only if the sample misled it (exact top-k over the whole difference)."""
    n = x.numel()
    k = max(0, min(k, n))
    if (k == 0 or k == n or method == "exact" or n < 4 * sample_size or 4 * k > n
            or not all(t.device.type == "cpu" and t.dtype in _FUSED_DTYPES
                       and t.dtype == x.dtype and t.is_contiguous() for t in (x, base, out))):
        torch.sub(x, base, out=out)
        return topk_select(out, k, method=method, generator=generator, sample_size=sample_size)
    xa, ba = x.numpy(), base.numpy()
    positions = torch.randint(n, (sample_size,), generator=generator).numpy()
    # IEEE subtraction in numpy and torch alike: the sample is the one topk_select would draw.
    threshold = _threshold(np.abs(xa[positions] - ba[positions]), k / n)
    scratch = _scratch.get("difference", min(_CHUNK, n), xa.dtype)
    candidates, values = _scan_values(_differences(xa, ba, scratch), threshold)
    if candidates.size < k:  # unlucky sample: the exact top-k needs the whole difference
        torch.sub(x, base, out=out)
    return _keep_k(out, k, candidates, values)


def abs_at_least(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Sorted int64 indices where ``|x| >= threshold`` (1-D contiguous ``x``)."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES:
        return torch.nonzero(x.abs() >= threshold).view(-1).cpu()
    return torch.from_numpy(_scan(x.numpy(), threshold))


def _chunks(a: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, a.size, _CHUNK):
        yield start, a[start:start + _CHUNK]


def _differences(a: np.ndarray, b: np.ndarray,
                 scratch: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``a - b`` chunk by chunk into ``scratch`` (one chunk long), each chunk handed on while
    it is in cache and overwritten by the next."""
    for start in range(0, a.size, _CHUNK):
        stop = min(start + _CHUNK, a.size)
        yield start, np.subtract(a[start:stop], b[start:stop], out=scratch[:stop - start])


def _scan(a: np.ndarray, threshold: float) -> np.ndarray:
    return _scan_values(_chunks(a), threshold, gather=False)[0]


def _scan_values(chunks: Iterable[tuple[int, np.ndarray]], threshold: float, *,
                 gather: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Sorted indices where ``|a| >= threshold`` over ``a``'s chunks, and (``gather``) the
    values there, taken from each chunk while it is in cache."""
    scratch = mask = t = None
    found, values = [], []
    for start, part in chunks:
        m = part.size
        if scratch is None:
            scratch, mask = _scratch.get("abs", m, part.dtype), _scratch.get("mask", m, bool)
            t = part.dtype.type(threshold)
        np.abs(part, out=scratch[:m])
        np.greater_equal(scratch[:m], t, out=mask[:m])
        hits = mask[:m].nonzero()[0]  # flatnonzero's wrapper (ravel, dispatch) skipped
        if hits.size:
            if gather:
                values.append(part[hits])
            hits += start
            found.append(hits)
    if not found:
        return np.zeros(0, dtype=np.int64), (np.zeros(0, dtype=scratch.dtype) if gather
                                             and scratch is not None else None)
    joined = np.concatenate(found) if len(found) > 1 else found[0]
    if not gather:
        return joined, None
    return joined, np.concatenate(values) if len(values) > 1 else values[0]


def _keep_k(x: torch.Tensor, k: int, candidates: np.ndarray,
            values: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top-k among the candidates (all of ``x`` if the sample placed the threshold
    too high)."""
    c = candidates.size
    if c < k:  # unlucky sample: the threshold was too high
        idx = _exact(x, k)
        return idx, x[idx]
    if c > k:
        # The k-th largest magnitude by a partition, then one comparison; the survivors keep
        # their sorted order, the ties at the k-th go to the lowest indices.
        magnitude = np.abs(values)
        kth = _kth_largest(magnitude, k)
        keep = magnitude >= kth
        extra = int(np.count_nonzero(keep)) - k
        if extra:
            keep[np.flatnonzero(magnitude == kth)[-extra:]] = False
        chosen = np.flatnonzero(keep)
        candidates, values = candidates[chosen], values[chosen]
    return torch.from_numpy(candidates), torch.from_numpy(values)


def _kth_largest(magnitude: np.ndarray, k: int):
    """The k-th largest of ``magnitude`` (0 < k < its size), exactly. A small set is
    partitioned whole: at 1M floats' ~15k candidates the buckets measured 2-3x faster
    alone but ~0.04 ms slower in the four-process round (more passes over cold memory)."""
    drop = magnitude.size - k
    if magnitude.size < _BUCKETS_FROM:
        return np.partition(magnitude, drop)[drop]
    return _order_statistic(magnitude, drop)


def _order_statistic(magnitude: np.ndarray, j: int):
    """The j-th smallest (from 0) of non-negative floats, exactly what ``np.partition`` puts
    at j (a NaN counts above +inf in both). Non-negative floats order as their bit patterns,
    so one pass counts them into buckets by their top ``_BUCKET_BITS`` bits (1/256 of an
    octave for float32), and only the bucket holding the j-th is partitioned: measured
    alone, 2-3x faster than partitioning all of them (14.6k magnitudes in ~35 against ~100
    us; 300k, the top-1% candidates at 25M, 0.5 against 1.2 ms for the earlier partial
    partition)."""
    width = 8 * magnitude.itemsize
    top = (magnitude.view(_UINTS[magnitude.itemsize])
           >> max(0, width - 1 - _BUCKET_BITS)).astype(np.intp)
    base = int(top.min())
    if base:
        top -= base
    ends = np.cumsum(np.bincount(top))
    bucket = int(np.searchsorted(ends, j, side="right"))
    members = magnitude[top == bucket]
    j -= int(ends[bucket - 1]) if bucket else 0
    return np.partition(members, j)[j]


def _exact(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest |x| by ``torch.topk``, ties at the k-th magnitude to
    the lowest indices (as ``_keep_k`` breaks them)."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    magnitude = x.abs()
    top = torch.topk(magnitude, k, sorted=False)
    kth = top.values.min()
    chosen = magnitude >= kth
    extra = int(chosen.sum()) - k
    if extra <= 0:  # no ties past the k-th (or a NaN among the top, which topk ranks first)
        # numpy's sort: torch's parallel sort crawls when the few cores are oversubscribed.
        return torch.from_numpy(np.sort(top.indices.cpu().numpy()))
    chosen[torch.nonzero(magnitude == kth).view(-1)[-extra:]] = False
    return torch.nonzero(chosen).view(-1).cpu()


def _threshold(sample: np.ndarray, p: float) -> float:
    """A sample value with a few standard deviations more than a fraction p above it."""
    s = sample.size
    above = math.ceil(s * p + MARGIN_SIGMAS * math.sqrt(s * p * (1 - p))) + 1
    kth = s - min(max(above, 1), s)
    return float(np.partition(sample, kth)[kth])


def _sampled_torch(x: torch.Tensor, k: int, generator: torch.Generator | None,
                   sample_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled method in torch ops, for bfloat16 and non-CPU tensors."""
    n = x.numel()
    positions = torch.randint(n, (sample_size,), generator=generator).to(x.device)
    threshold = _threshold(x[positions].abs().float().cpu().numpy(), k / n)
    candidates = torch.nonzero(x.abs() >= threshold).view(-1)
    c = candidates.numel()
    if c < k:
        idx = _exact(x, k)
        return idx, x[idx]
    values = x[candidates]
    if c > k:  # as _keep_k: the k-th magnitude, then the ties at it to the lowest indices
        magnitude = values.abs().float()  # exact for every float dtype; kthvalue takes it
        kth = torch.kthvalue(magnitude, c - k + 1).values
        keep = magnitude >= kth
        extra = int(keep.sum()) - k
        if extra:
            keep[torch.nonzero(magnitude == kth).view(-1)[-extra:]] = False
        candidates, values = candidates[keep], values[keep]
    return candidates.cpu(), values
