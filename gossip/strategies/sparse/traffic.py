"""The sparse all-reduces' message patterns with sizes (gossip/strategies/traffic.py): the
schedules and the wire meta the strategies themselves use, the values left out."""

from __future__ import annotations

import functools

import numpy as np
import torch

from gossip.compress.indices import encode_indices
from gossip.compress.sparse import k_for
from gossip.strategies.traffic import Step, message_bytes
from gossip.strategies.sparse.wire import block_meta


@functools.lru_cache(maxsize=64)
def block_index_bytes(k: int, length: int, coding: str) -> tuple[str, int]:
    """(scheme, bytes) of the indices of a block of ``k`` entries in ``length``: exact for
    int32; for compact, the code of ``k`` evenly spread indices (real ones vary a little)."""
    if coding == "int32":
        return "raw", 4 * k
    idx = torch.from_numpy(np.linspace(0, length - 1, k).astype(np.int64))
    scheme, data = encode_indices(torch.unique(idx), length)
    return scheme, data.numel()


def blocks_bytes(rank: int, kind: str, n: int, step: int, ids: np.ndarray, k: int,
                 length: int, dtype: torch.dtype, coding: str) -> int:
    """Bytes of one message of the wire format of gossip/strategies/sparse/wire.py carrying
    blocks ``ids`` of ``k`` entries each."""
    m = len(ids)
    scheme, nb = block_index_bytes(k, length, coding)
    meta = block_meta(n, step, ids.tolist(), [k] * m, [scheme] * m, [nb] * m)
    return message_bytes(rank, kind, meta, [(dtype, m * k), (torch.uint8, m * nb)])


def spardl_traffic(rank: int, size: int, n: int, dtype: torch.dtype, options,
                   reduce_scatter: list, all_gather: list) -> list[Step]:
    """SparDL's round (gossip/strategies/sparse/spardl.py) on its schedules of (distance,
    blocks): reduce-scatter steps, then all-gather steps, each one message out and one in."""
    p, r = size, rank
    length = -(-n // p)
    k = k_for(options.density, length)
    rs, ag = f"{options.tag}.rs", f"{options.tag}.ag"
    steps = []
    for step, (d, m) in enumerate(reduce_scatter):
        ids = (r + d + np.arange(m)) % p
        nbytes = blocks_bytes(r, rs, n, step, ids, k, length, dtype, options.indices)
        steps.append(Step((((r + d) % p, rs, nbytes),), (((r - d) % p, rs),)))
    for step, (d, m) in enumerate(all_gather):
        ids = (r + np.arange(m)) % p
        nbytes = blocks_bytes(r, ag, n, step, ids, k, length, dtype, options.indices)
        steps.append(Step((((r - d) % p, ag, nbytes),), (((r + d) % p, ag),)))
    return steps


def _one_block(rank: int, kind: str, n: int, step: int, dtype, options) -> int:
    """Bytes of a message carrying one set of k entries of the whole tensor (block 0)."""
    k = k_for(options.density, n)
    return blocks_bytes(rank, kind, n, step, np.zeros(1, dtype=np.int64), k, n, dtype,
                        options.indices)


def topk_allgather_traffic(rank: int, size: int, n: int, dtype: torch.dtype,
                           options) -> list[Step]:
    """TopK-AllGather's round: one set to every other peer, then one from each."""
    others = [p for p in range(size) if p != rank]
    nbytes = _one_block(rank, options.tag, n, 0, dtype, options)
    return [Step(tuple((dst, options.tag, nbytes) for dst in others),
                 tuple((src, options.tag) for src in others))]


def gtopk_traffic(rank: int, size: int, n: int, dtype: torch.dtype, options,
                  reduce: list, broadcast: list) -> list[Step]:
    """gTop-k's round on its tree steps (``reduce_steps``, ``broadcast_steps``): merges
    keep k entries, so every message carries k."""
    up, down = f"{options.tag}.up", f"{options.tag}.down"
    steps = []
    for action, peer, level in reduce:
        if action == "send":
            steps.append(Step(((peer, up, _one_block(rank, up, n, level, dtype, options)),), ()))
        else:
            steps.append(Step((), ((peer, up),)))
    nbytes = _one_block(rank, down, n, 0, dtype, options)
    sends = tuple((peer, down, nbytes) for action, peer in broadcast if action == "send")
    recvs = tuple((peer, down) for action, peer in broadcast if action == "recv")
    return steps + [Step((), recvs), Step(sends, ())]
