"""Peers of a gradient all-reduce must start from one model: checked once, before round 0.

Averaging gradients keeps every peer's model equal only if the models were equal to begin
with; two peers that start apart stay apart forever and nothing else would notice (torch's
DistributedDataParallel broadcasts rank 0's parameters at construction for this reason).
The usual way to get there by accident: peers as threads of one process, each calling
``torch.manual_seed(s)`` and building its model. torch's default generator is one per
process, so the threads' draws interleave and the models differ (on 2 cores, 8 of 20
tries at 3 threads, 17 of 20 at 5).

The check sends a digest of the parameters to the next rank of the ring 0 -> 1 -> ... ->
P-1 -> 0 and compares the previous rank's with its own: equal all round means equal
everywhere. A mismatch raises a ``ConfigError`` on the peer that saw it; the others stop as they do
when a peer of an all-reduce leaves (its message may never have left). One small message
per peer, once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from gossip.errors import ConfigError
from gossip.strategies.traffic import Step, message_bytes
from gossip.transport import Message

KIND = "start"
DIGEST_CHARS = 32  # blake2b of 16 bytes, in hex


def parameter_digest(params: Iterable[torch.Tensor]) -> str:
    """blake2b (hex) of the parameters' shapes, dtypes and values, in order."""
    digest = hashlib.blake2b(digest_size=16)
    for p in params:
        t = p.detach()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def needs_check(peer) -> bool:
    """Whether ``peer`` starts a run whose exchanges keep every model equal: a gradient round
    0 with every rank taking part, not a restart (a rejoining peer's neighbours are past it)."""
    strategy = peer.strategy
    return (peer.round == 0 and strategy.needs_every_peer and starting_members(peer) > 1
            and strategy.round_plan(0).operates_on == "grads")


def starting_members(peer) -> int:
    """Ranks 0..n-1 start the run: all but an elastic run's spares (they join later, from
    a member's state)."""
    return peer.topology.size - peer.spares


def start_step(rank: int, size: int) -> Step:
    """The check as the sizes-only simulation replays it before round 0's plan (a strategy
    with a traffic plan averages gradients with every rank: it always runs the check)."""
    nbytes = message_bytes(rank, KIND, {"digest": "0" * DIGEST_CHARS}, [])
    return Step(sends=(((rank + 1) % size, KIND, nbytes),), recvs=(((rank - 1) % size, KIND),))


def expect(transport) -> None:
    """Take the check's message from now on, before the run's first receive: a peer further
    on sends its digest at its first step, maybe while this one still computes round 0 and
    reads (nonblocking polls for STOPs), and a kind not taken yet would be rejected there (the
    check then waited for it until the timeout)."""
    transport.accept_kinds((KIND,))
    transport.membership.collective((KIND,))  # a peer that refused stops everyone's check


def check_same_start(peer, params: Iterable[torch.Tensor]) -> None:
    """Raise ConfigError unless the previous rank's parameters equal ours (see the module);
    its message is taken since ``expect``.

    Raises:
        ConfigError: they differ (the message names both ranks and the likely cause).
    """
    transport, rank, size = peer.transport, peer.rank, starting_members(peer)
    mine = parameter_digest(params)
    left = (rank - 1) % size
    transport.send((rank + 1) % size, Message(KIND, 0, meta={"digest": mine}))
    theirs = transport.recv(src=left, kind=KIND, round=0).meta.get("digest")
    if theirs != mine:
        raise ConfigError(
            f"rank {rank}: rank {left} starts from other parameters than this peer, and "
            f"{peer.builder.name} averages gradients, so their models would never meet: build "
            f"every peer's model from one seed (peers as threads share torch's generator: build "
            f"the models before starting the threads, or load one state_dict into each)")
