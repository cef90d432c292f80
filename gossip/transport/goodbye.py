"""Leaving a run: the goodbye handshake of ``Transport.shutdown``.

Once a contact's goodbye arrived, everything it sent before has arrived too (per-pair FIFO)
and it no longer needs anything from us. Peers we are only linked to (``connect``, nothing
exchanged yet, e.g. this peer took no step) get a goodbye too, so they neither wait for this
peer nor take its leaving for a death; their goodbye is not waited for, but their link must
be up for ours to leave (a peer still starting), so that much is. A contact whose link never
came up in the time a dead peer is given is not waited for either: nothing listens at its
address (a joiner started after the members it asked ended, a spare that never started).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gossip.clock import Clock
from gossip.errors import PeerTimeout

log = logging.getLogger("gossip.transport")

LINK_CHECK_S = 0.1  # how often a leaving peer looks whether one it must tell is reachable


@dataclass(frozen=True)
class Leaving:
    """What leaving asks of a transport. ``contacts`` (sent to or heard from) and
    ``departed`` (said goodbye) are its live sets, which ``wait`` updates."""

    rank: int
    clock: Clock
    describe: Callable[[int], str]
    contacts: set[int]
    departed: set[int]
    linked: set[int]
    lost: Callable[[], set[int]]  # every peer known lost, also only reported
    unreached: Callable[[], set[int]]  # links that never came up within dead_after
    dead: set[int]  # first-hand losses: told nothing
    say_goodbye: Callable[[int], None]
    wait: Callable[[float], bool]  # wait for one message and handle it; False: none came
    link_up: Callable[[int], bool]


def leave(how: Leaving, timeout: float) -> set[int]:
    """Say goodbye, and wait up to ``timeout`` seconds for the contacts' goodbyes and the
    links to the peers only linked to. Returns the peers that did not say goodbye, or could
    not be told (dead, stuck, or never started)."""
    only_linked = how.linked - how.contacts
    told: set[int] = set()

    def tell() -> None:  # also a contact made meanwhile (a late message): it waits for ours
        for dst in sorted((how.contacts | only_linked) - how.dead - told):  # the gone too
            told.add(dst)
            try:
                how.say_goodbye(dst)
            except PeerTimeout:  # its queue is full: it is stuck, and told of nothing more
                pass

    def awaited() -> set[int]:  # lost peers (even only reported ones) say nothing more
        return how.contacts - only_linked - how.departed - how.lost()

    def silent() -> set[int]:
        return awaited() - how.unreached()

    def untold() -> set[int]:
        return {r for r in only_linked - how.departed - how.lost() if not how.link_up(r)}

    clock = how.clock
    deadline = clock.monotonic() + timeout
    tell()
    while (silent() or untold()) and clock.monotonic() < deadline:
        # in short steps: a link may be found never to come up while nothing arrives
        how.wait(max(min(deadline - clock.monotonic(), LINK_CHECK_S), 0.0))
        tell()
    missing, untold_now = silent(), untold()
    nobody = awaited() & how.unreached()
    if missing:
        log.warning("rank %d: no goodbye from %s within %g s", how.rank,
                    ", ".join(how.describe(r) for r in sorted(missing)), timeout)
    if untold_now:
        log.warning("rank %d: could not say goodbye to %s within %g s (not reached)", how.rank,
                    ", ".join(how.describe(r) for r in sorted(untold_now)), timeout)
    if nobody:
        log.info("rank %d: no goodbye awaited from %s: nothing listens there", how.rank,
                 ", ".join(how.describe(r) for r in sorted(nobody)))
    return missing | untold_now | nobody
