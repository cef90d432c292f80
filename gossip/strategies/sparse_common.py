"""What the sparse all-reduce strategies share: residual state, exact top-k selection,
sorted sparse-set arithmetic, the sparse-block wire format and per-phase timers.

A sparse set is a pair of numpy arrays: strictly increasing int64 indices and their values
(in the tensor's dtype). Exact zeros are never sent: they carry no mass, and gradients of
ReLU networks hold many of them.

Wire format of one message (any number of blocks of one tensor)::

    meta = {"n": tensor length, "s": step, "b": [block ids], "k": [counts],
            "ix": [index scheme per block], "nb": [index bytes per block]}
    buffers = (values of all blocks, concatenated; index data of all blocks, uint8)

Indices are block-local and travel in the encodings of ``gossip.compress.indices``: the
smallest of its schemes (``indices="compact"``, about 1.1 bytes per index at 1% density) or
plain int32 (``indices="int32"``). Each block is encoded once by the peer that selects it;
a peer forwarding a block forwards its bytes. Everything received is validated (block ids,
counts, dtype, indices sorted, distinct and in range) and a violation raises ProtocolError
naming the peer.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossip.compress.base import check_density
from gossip.compress.indices import decode_indices, encode_indices
from gossip.compress.selection import SAMPLE_SIZE, topk_select
from gossip.compress.sparse import k_for
from gossip.errors import ConfigError, ProtocolError
from gossip.strategies.base import Strategy
from gossip.transport import Message

INDEX_CODINGS = ("compact", "int32")
#: Working dtypes (numpy has no bfloat16).
DTYPES = (torch.float32, torch.float64, torch.float16)
_EMPTY_IDX = np.zeros(0, dtype=np.int64)

__all__ = ["Block", "SparseStrategy", "Timings", "encode_block", "k_for", "keep_topk", "member",
           "merge_sum", "pack", "select", "unpack"]


# -- selection and sorted-set arithmetic -------------------------------------------------


def select(x: torch.Tensor, k: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sorted indices of the ``k`` largest ``|x|`` (exact) and ``x`` there, zeros left out.

    The values are a copy: ``x`` may be modified afterwards.
    """
    # A sample of n/128 places the threshold well enough (a few % more candidates than k);
    # the compressor's default (131k) costs more than the scan of a 600k-element block.
    sample = min(SAMPLE_SIZE, max(4096, x.numel() // 128))
    idx, val = topk_select(x, k, generator=generator, sample_size=sample)
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


# -- wire format -------------------------------------------------------------------------


@dataclass
class Block:
    """One sparse block as it travels: decoded indices and values, and its wire bytes."""

    id: int
    idx: np.ndarray   # int64, block-local, sorted, distinct
    val: np.ndarray
    scheme: str
    data: np.ndarray  # uint8 index data


def encode_block(block_id: int, idx: np.ndarray, val: np.ndarray, length: int,
                 coding: str) -> Block:
    """``idx`` (sorted, in [0, length)) and ``val`` in their wire form."""
    if coding == "int32":
        scheme, data = "raw", idx.astype("<i4").view(np.uint8)
    else:
        scheme, encoded = encode_indices(torch.from_numpy(idx), length)
        data = encoded.numpy()
    return Block(block_id, idx, val, scheme, data)


def pack(kind: str, round: int, blocks: Sequence[Block], *, n: int, step: int) -> Message:
    """One message carrying ``blocks`` of a tensor of length ``n``."""
    meta = {"n": n, "s": step, "b": [b.id for b in blocks], "k": [int(b.idx.size) for b in blocks],
            "ix": [b.scheme for b in blocks], "nb": [int(b.data.size) for b in blocks]}
    if len(blocks) == 1:
        values, data = blocks[0].val, blocks[0].data
    else:
        values = np.concatenate([b.val for b in blocks])
        data = np.concatenate([b.data for b in blocks])
    return Message(kind=kind, round=round, meta=meta,
                   buffers=(_tensor(values), _tensor(data)))


def _tensor(a: np.ndarray) -> torch.Tensor:
    # numpy gives empty results stride 0, which the codec's byte view rejects.
    tensor = torch.from_numpy(a)
    return tensor if a.size else torch.empty(0, dtype=tensor.dtype)


def unpack(msg: Message, *, rank: int, n: int, step: int, blocks: Sequence[int], length: int,
           limit: int, dtype: torch.dtype) -> list[Block]:
    """The blocks of ``msg``, checked against what the schedule expects.

    Args:
        blocks: The block ids expected, in order.
        length: Block length (indices lie in [0, length)).
        limit: Most entries a block may carry.

    Raises:
        ProtocolError: naming the sender and what is wrong.
    """
    def fail(reason: str) -> ProtocolError:
        return ProtocolError(f"rank {rank}: peer {msg.src} sent {msg.kind} round {msg.round} "
                             f"step {step}: {reason}")

    meta = msg.meta
    if meta.get("n") != n:
        raise fail(f"tensor length {meta.get('n')!r}, ours is {n} (do all peers synchronize "
                   f"tensors of the same length?)")
    if meta.get("s") != step or meta.get("b") != list(blocks):
        raise fail(f"step {meta.get('s')!r} blocks {meta.get('b')!r}, expected step {step} "
                   f"blocks {list(blocks)}")
    counts, schemes, sizes = meta.get("k"), meta.get("ix"), meta.get("nb")
    m = len(blocks)
    if not (_int_list(counts, m) and _int_list(sizes, m) and isinstance(schemes, list)
            and len(schemes) == m and all(isinstance(s, str) for s in schemes)):
        raise fail(f"malformed block header k={counts!r} ix={schemes!r} nb={sizes!r}")
    if len(msg.buffers) != 2:
        raise fail(f"{len(msg.buffers)} buffers, expected 2 (values, index data)")
    values, data = msg.buffers
    if values.dtype != dtype or data.dtype != torch.uint8:
        raise fail(f"buffers of {values.dtype} and {data.dtype}, expected {dtype} and uint8")
    if any(not 0 <= c <= limit for c in counts):
        raise fail(f"block counts {counts} exceed the {limit} entries a block may carry")
    if values.numel() != sum(counts) or data.numel() != sum(sizes) or min(sizes, default=0) < 0:
        raise fail(f"{values.numel()} values and {data.numel()} index bytes, header says "
                   f"{sum(counts)} and {sum(sizes)}")
    values, data = values.numpy(), data.numpy()
    out, v0, d0 = [], 0, 0
    for block_id, count, scheme, size in zip(blocks, counts, schemes, sizes):
        raw = data[d0:d0 + size]
        try:
            idx = decode_indices(scheme, torch.from_numpy(raw), count, length).numpy()
        except ProtocolError as exc:
            raise fail(f"block {block_id}: {exc}") from None
        out.append(Block(block_id, idx, values[v0:v0 + count], scheme, raw))
        v0, d0 = v0 + count, d0 + size
    return out


def _int_list(value: Any, length: int) -> bool:
    return (isinstance(value, list) and len(value) == length
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


# -- timing --------------------------------------------------------------------------------


class Timings(dict):
    """Seconds per phase of one synchronize: load (x + residual), select (top-k, residual
    update), encode and decode (index coding, message checks), reduce (merging,
    accumulating, the result), send and recv (in the transport; recv includes wait, the
    time blocked on the socket), and total. ``cpu`` maps each phase to this thread's CPU
    seconds in it: on shared cores the wall time also counts time spent descheduled."""

    def __init__(self):
        super().__init__()
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.perf_counter() - start
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - cpu


# -- the strategies' base --------------------------------------------------------------------


class SparseStrategy(Strategy):
    """Residual bookkeeping and option checks of the sparse all-reduce strategies.

    The result is the mean (sum / P) of a sparse aggregate of the peers' ``x + residual``;
    whatever a peer put in and the aggregate left out stays in the peers' residuals, so
    ``sum over peers of (x + old residual) == P * result + sum of new residuals``.

    Args:
        density: Fraction of entries kept, in (0, 1]; k = max(1, ceil(density * n)).
        error_feedback: Add the residual to the next round's input. With False the residual
            is still computed (and exposed) every round, but the next round starts from its
            input alone: what was left out is dropped.
        tag: Message kind prefix, distinct per instance sharing one transport.
        indices: Index wire encoding, ``"compact"`` (smallest of the compress encodings) or
            ``"int32"`` (cheaper to encode, 4 bytes per index).
    """

    operates_on = "grads"

    def __init__(self, *, rank, topology, transport, density: float, error_feedback: bool,
                 tag: str, indices: str):
        super().__init__(rank=rank, topology=topology, transport=transport)
        self.density = check_density(density)
        if not isinstance(error_feedback, bool):
            raise ConfigError(f"error_feedback must be true or false, got {error_feedback!r}")
        if indices not in INDEX_CODINGS:
            raise ConfigError(f"indices must be one of {', '.join(INDEX_CODINGS)}, "
                              f"got {indices!r}")
        self.error_feedback = error_feedback
        self.tag = tag
        self.indices = indices
        self.timings = Timings()  # of the last synchronize
        self._work: torch.Tensor | None = None  # x + residual, then the new residual
        self._numel = 0
        # Sample positions of the selection; any seed gives the same (exact) top-k.
        self._generator = torch.Generator().manual_seed(1 + rank)

    # -- state -------------------------------------------------------------------------

    @property
    def residual(self) -> torch.Tensor | None:
        """What this peer's last round left out (flat), or None before the first round."""
        return None if self._work is None else self._work[:self._numel]

    def state_dict(self) -> dict[str, Any]:
        return {"residual": None if self._work is None else self.residual.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        residual = state.get("residual")
        if residual is None:
            self._work, self._numel = None, 0
            return
        residual = residual.reshape(-1)
        self._numel = residual.numel()
        self._work = torch.zeros(self._padded(self._numel), dtype=residual.dtype)
        self._work[:self._numel].copy_(residual)

    # -- one round -----------------------------------------------------------------------

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in DTYPES:
            raise ConfigError(f"{type(self).__name__} averages float32, float64 or float16 "
                              f"tensors, got {x.dtype}")
        flat, dest = x.reshape(-1), self._output(x, out)
        self.timings = timings = Timings()
        waited = self.transport.stats.wait_s
        with timings("total"):
            if flat.numel():
                with timings("load"):
                    work = self._load(flat)
                self._run(work, flat.numel(), dest, round, timings)
        timings["wait"] = self.transport.stats.wait_s - waited
        return dest.view_as(x)

    def _load(self, flat: torch.Tensor) -> torch.Tensor:
        """The working buffer holding ``x + residual`` (or ``x`` without error feedback)."""
        n = flat.numel()
        work = self._work
        if work is not None and self._numel != n:
            raise ConfigError(f"{type(self).__name__} got a tensor of {n} elements; its "
                              f"residual has {self._numel} (use one instance per tensor)")
        if work is not None and work.dtype != flat.dtype:
            work = self._work = work.to(flat.dtype)
        if work is None:
            work = self._work = torch.zeros(self._padded(n), dtype=flat.dtype)
            self._numel = n
            work[:n].copy_(flat)
        elif self.error_feedback:
            work[:n].add_(flat)
        else:
            work[:n].copy_(flat)
        return work

    def _padded(self, n: int) -> int:
        """Length of the working buffer for a tensor of ``n``."""
        return n

    def _k(self, n: int) -> int:
        return k_for(self.density, n)

    def _send(self, dst: int, msg: Message, timings: Timings) -> None:
        # Fresh buffers that nothing modifies later: no need to track the delivery.
        with timings("send"):
            self.transport.send(dst, msg)

    def _recv(self, src: int, kind: str, round: int, timings: Timings) -> Message:
        with timings("recv"):
            return self.transport.recv(src=src, kind=kind, round=round)

    @abstractmethod
    def _run(self, work: torch.Tensor, n: int, dest: torch.Tensor, round: int,
             timings: Timings) -> None:
        """Write the mean of the sparse aggregate to ``dest`` and leave the new residual in
        ``work`` (which held this peer's input)."""
