"""Exact averages inside a group of peers (hierarchical local SGD)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossip.errors import ConfigError
from gossip.transport import Message, Transport


def resolve_groups(groups, topology) -> tuple[tuple[int, ...], ...]:
    """The groups as sorted rank tuples: ``"hosts"`` groups the peers sharing a host (in
    order of their first rank); a list must cover every rank of ``topology`` once.

    Raises:
        ConfigError: ``local: groups: ...`` naming a rank not in the topology or missing.
    """
    if groups == "hosts":
        by_host: dict[str, list[int]] = {}
        for peer in topology.peers:
            by_host.setdefault(peer.host, []).append(peer.rank)
        return tuple(tuple(ranks) for ranks in by_host.values())
    ranks = [rank for group in groups for rank in group]
    outside = sorted(r for r in ranks if r >= topology.size)
    if outside:
        raise ConfigError(f"local: groups: rank {outside[0]} is not in the topology (ranks "
                          f"0..{topology.size - 1})")
    missing = sorted(set(range(topology.size)) - set(ranks))
    if missing:
        raise ConfigError(f"local: groups: rank {missing[0]} is in no group (the groups must "
                          f"cover every rank once)")
    return tuple(tuple(sorted(group)) for group in groups)


class GroupMean:
    """The exact mean over ``members`` (this rank among them): every member sends its
    vector to every other and sums all of them in rank order, so the members' results are
    bitwise equal. (g - 1) M values each way per member: meant for small groups, such as
    the peers of one host."""

    def __init__(self, rank: int, members: Sequence[int], transport: Transport, kind: str):
        self.rank, self.members = rank, tuple(members)
        self.transport, self.kind = transport, kind

    def average(self, flat: torch.Tensor, round: int, dest: torch.Tensor,
                expect) -> torch.Tensor:
        """The members' mean of ``flat`` into ``dest`` (which may be ``flat``);
        ``expect(msg, numel)`` checks a received vector."""
        others = [m for m in self.members if m != self.rank]
        message = Message(kind=self.kind, round=round, meta={"n": flat.numel()},
                          buffers=(flat,))
        sent = [self.transport.send(m, message, track=True) for m in others]
        values = {self.rank: flat}
        for m in others:
            values[m] = expect(self.transport.recv(src=m, kind=self.kind, round=round),
                               flat.numel())
        total = values[self.members[0]].clone()
        for m in self.members[1:]:  # rank order: the same floating-point sum everywhere
            total.add_(values[m])
        for delivery in sent:  # our frames are read zero-copy: wait before flat may change
            delivery.wait()
        return torch.div(total, len(self.members), out=dest)
