"""SGP's options: the push graph (a schedule or explicit directed edges) and the overlap."""

from __future__ import annotations

from dataclasses import dataclass

from gossip.options import TaggedOptions, option
from gossip.topology.directed import SCHEDULES

#: Messages older than this many rounds are not kept by the transport (transport/pending.py).
MAX_OVERLAP = 15


@dataclass(frozen=True)
class SGPOptions(TaggedOptions, tag="sgp"):
    """Options of ``sgp``."""

    examples = ({}, {"schedule": "graph"}, {"overlap": 1})

    schedule: str = option("one-peer-exponential", "whom each peer pushes to: the topology's "
                           "graph both ways, or one peer per step at offsets 1, 2, 4, ...",
                           choices=SCHEDULES)
    edges: list | None = option(None, "explicit directed edges [[from, to], ...] (instead of "
                                      "the schedule); the graph must be strongly connected")
    overlap: int = option(0, "tau: mix what has arrived up to tau steps late, wait only for "
                             "messages tau steps old (0: each step waits for its senders)",
                          check=lambda t: None if 0 <= t <= MAX_OVERLAP
                          else f"must be in 0..{MAX_OVERLAP}")
