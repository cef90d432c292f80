"""A whole job restarted together (torchrun restarts every worker when one fails): its
peers died at different rounds, and agree through the store on the newest checkpoint round
every one of them has (each keeps two generations, gossip.checkpoint)."""

from __future__ import annotations

import json

from gossip.errors import CheckpointError, RendezvousError
from gossip.rendezvous.store import Rendezvous


def common_round(rendezvous: Rendezvous, rank: int, size: int, rounds) -> int | None:
    """Publish the rounds this peer has checkpoints of and read everyone's: the newest round
    all have, or None when no peer has any (the job starts afresh).

    Raises:
        CheckpointError: some peer has no checkpoint, or no round is common to all,
            naming the peers and their rounds.
    """
    published = rendezvous.exchange("checkpoints", rank, size,
                                    json.dumps(sorted(rounds)).encode())
    held = []
    for r, data in enumerate(published):
        try:
            held.append({int(x) for x in json.loads(data)})
        except (ValueError, TypeError):
            raise RendezvousError(f"rank {r} published malformed checkpoint rounds "
                                  f"{data[:100]!r}") from None
    if not any(held):
        return None
    without = [r for r, mine in enumerate(held) if not mine]
    if without:
        raise CheckpointError(f"cannot resume the restarted job: peer(s) "
                              f"{', '.join(map(str, without))} have no checkpoint (the others do)")
    common = set.intersection(*held)
    if not common:
        have = "; ".join(f"peer {r}: {', '.join(map(str, sorted(mine)))}"
                         for r, mine in enumerate(held))
        raise CheckpointError(f"cannot resume the restarted job: no checkpoint round is kept "
                              f"by every peer ({have}); use a --checkpoint-every larger than the "
                              f"graph's diameter")
    return max(common)
