"""When a message sent in a simulation arrives: a model of the netns virtual cluster.

Each peer has an uplink and a downlink capped at a rate (gossip/cluster shapes each
namespace's link with tbf, both ways). A message is a flow from its sender's uplink to its
receiver's downlink; it arrives ``latency`` after its last byte left. Before its first byte
leaves, the sender's CPU spends ``message_s + bytes * byte_s`` on it (encoding, the socket,
the kernel: constants fitted on real runs, see experiments/sim-validation.yaml).

Two ways to share a link:

* ``fifo``: each link sends one message at a time, in order: a message leaves its sender's
  uplink after those queued before it, and its receiver's downlink takes it as it comes,
  after what it was still receiving, at the slower link's rate (cheap: O(1) per message).
* ``fair``: every pair of peers has one connection, which carries its messages in order
  (as one TCP connection does); every connection with bytes in flight gets its max-min fair
  share of both links, recomputed whenever one starts, ends or moves on to its next message
  (TCP's long-run behaviour; O(connections x links) per change).

tbf counts link-layer bytes: a full TCP segment carries 1448 bytes of payload in a 1514-byte
Ethernet frame, so the goodput of a link is ``GOODPUT`` (0.956) times its rate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gossip.cluster.rate import parse_rate
from gossip.errors import ConfigError
from gossip.sim.scheduler import Scheduler

GOODPUT = 1448 / 1514  # payload per full Ethernet frame of TCP (timestamps on): 0.956
SHARING = ("fifo", "fair")


def _seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ConfigError(f"network {name}: expected seconds >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class NetworkModel:
    """The simulated network's parameters; every value checked, errors name it.

    Attributes:
        rate: Every link's rate each way (tc's units, e.g. ``1gbit``, or bits/s); None:
            unlimited (only latency and per-message costs take time).
        rates: ``{rank: rate}``: that peer's links at another rate.
        latency: Seconds from a message's last byte leaving to its arrival.
        sharing: ``fifo`` or ``fair`` (module docstring).
        goodput: Payload bytes per byte the shaper counts.
        message_s: Sender CPU seconds per message.
        byte_s: Sender CPU seconds per byte.
    """

    rate: str | int | None = None
    rates: Mapping[int, str | int] = field(default_factory=dict)
    latency: float = 0.0
    sharing: str = "fifo"
    goodput: float = GOODPUT
    message_s: float = 0.0
    byte_s: float = 0.0

    def __post_init__(self):
        for name in ("latency", "message_s", "byte_s"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))
        if self.rate is not None:
            parse_rate(self.rate)
        for rank, rate in self.rates.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ConfigError(f"network rates: {rank!r} is not a rank")
            parse_rate(rate)
        if self.sharing not in SHARING:
            raise ConfigError(f"network sharing: {self.sharing!r} is not one of "
                              f"{', '.join(SHARING)}")
        if isinstance(self.goodput, bool) or not isinstance(self.goodput, (int, float)) or \
                not 0 < self.goodput <= 1:
            raise ConfigError(f"network goodput: expected a fraction in (0, 1], got "
                              f"{self.goodput!r}")

    def check_ranks(self, size: int) -> None:
        for rank in self.rates:
            if rank >= size:
                raise ConfigError(f"network rates: rank {rank} is not in the run "
                                  f"(ranks 0..{size - 1})")

    def bytes_per_s(self, rank: int) -> float:
        """Payload bytes per second through ``rank``'s links (inf: unlimited)."""
        rate = self.rates.get(rank, self.rate)
        return math.inf if rate is None else parse_rate(rate).bytes_per_s * self.goodput

    def to_dict(self) -> dict:
        return {"rate": None if self.rate is None else str(self.rate),
                "rates": {r: str(v) for r, v in self.rates.items()}, "latency": self.latency,
                "sharing": self.sharing, "goodput": self.goodput,
                "message_s": self.message_s, "byte_s": self.byte_s}

    @classmethod
    def from_dict(cls, data: Mapping | None) -> NetworkModel:
        """From a YAML mapping; errors name the unknown field."""
        data = dict(data or {})
        known = list(cls.__dataclass_fields__)
        for key in data:
            if key not in known:
                raise ConfigError(f"network: unknown field {key!r}; fields: {', '.join(known)}")
        data["rates"] = {int(k) if str(k).isdigit() else k: v
                         for k, v in dict(data.get("rates") or {}).items()}
        return cls(**data)

    def build(self, scheduler: Scheduler, size: int) -> Links:
        self.check_ranks(size)
        speeds = [self.bytes_per_s(rank) for rank in range(size)]
        kind = FairLinks if self.sharing == "fair" else FifoLinks
        return kind(self, scheduler, speeds)


class Links:
    """The state of every link during a run: ``send`` schedules a message's arrival."""

    def __init__(self, model: NetworkModel, scheduler: Scheduler, speeds: list[float]):
        self.model, self.scheduler, self.speeds = model, scheduler, speeds

    def send(self, src: int, dst: int, nbytes: int, arrive: Callable[[], None]) -> None:
        raise NotImplementedError

    def _cpu(self, nbytes: int) -> float:
        return self.model.message_s + nbytes * self.model.byte_s


class FifoLinks(Links):
    """Each link one message at a time, in order (module docstring)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.up_free = [0.0] * len(self.speeds)
        self.down_free = [0.0] * len(self.speeds)

    def send(self, src: int, dst: int, nbytes: int, arrive: Callable[[], None]) -> None:
        start = max(self.scheduler.now, self.up_free[src]) + self._cpu(nbytes)
        sent = start + _seconds_for(nbytes, self.speeds[src])
        self.up_free[src] = sent  # the uplink goes on with the next message at once
        # The downlink takes the bytes as they come, after what it was still receiving,
        # and no faster than either link.
        begin = max(start, self.down_free[dst])
        received = max(sent, begin + _seconds_for(nbytes, self.speeds[dst]))
        self.down_free[dst] = received
        self.scheduler.at(received + self.model.latency, arrive)


def _seconds_for(nbytes: int, speed: float) -> float:
    return nbytes / speed if speed < math.inf else 0.0


class _Connection:
    """A pair's one ordered connection: its queued messages as ``[bytes left, arrive]``,
    the head's bytes moving at ``rate``."""

    __slots__ = ("src", "dst", "queue", "rate")

    def __init__(self, src: int, dst: int):
        self.src, self.dst, self.queue, self.rate = src, dst, deque(), 0.0

    @property
    def left(self) -> float:
        return self.queue[0][0]


class FairLinks(Links):
    """Max-min fair sharing of every uplink and downlink among the pairs' connections with
    bytes in flight; each connection delivers its messages in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.flows: dict[tuple[int, int], _Connection] = {}  # the busy connections
        self.cpu_free = [0.0] * len(self.speeds)  # a sender's CPU prepares one at a time
        self._updated = 0.0
        self._version = 0

    def send(self, src: int, dst: int, nbytes: int, arrive: Callable[[], None]) -> None:
        ready = max(self.scheduler.now, self.cpu_free[src]) + self._cpu(nbytes)
        self.cpu_free[src] = ready
        self.scheduler.at(ready, self._start, src, dst, float(nbytes), arrive)

    def _start(self, src: int, dst: int, nbytes: float, arrive: Callable[[], None]) -> None:
        busy = self.flows.get((src, dst))
        if busy is not None:
            busy.queue.append([nbytes, arrive])  # behind the pair's earlier messages
            return
        if math.isinf(min(self.speeds[src], self.speeds[dst])) or nbytes == 0:
            self.scheduler.at(self.scheduler.now + self.model.latency, arrive)
            return
        self._progress()
        connection = self.flows[src, dst] = _Connection(src, dst)
        connection.queue.append([nbytes, arrive])
        self._reschedule()

    def _progress(self) -> None:
        """Count the bytes every connection's head message moved since the last change (an
        event falls due at each head's end, so none moves past it)."""
        now = self.scheduler.now
        elapsed, self._updated = now - self._updated, now
        for connection in self.flows.values():
            connection.queue[0][0] -= connection.rate * elapsed

    def _reschedule(self) -> None:
        self._share()
        self._version += 1
        if self.flows:
            soonest = min(max(c.left, 0.0) / c.rate for c in self.flows.values())
            self.scheduler.at(self.scheduler.now + soonest, self._finish, self._version)

    def _finish(self, version: int) -> None:
        if version != self._version:
            return  # the flows changed since: a later event stands
        self._progress()
        arrival = self.scheduler.now + self.model.latency
        for key, connection in list(self.flows.items()):
            queue = connection.queue
            while queue and queue[0][0] <= 1e-6 * max(connection.rate, 1.0):
                overshoot, arrive = queue.popleft()
                self.scheduler.at(arrival, arrive)
                if queue:
                    queue[0][0] += min(overshoot, 0.0)  # rounding past the end: the next one's
            if not queue:
                del self.flows[key]
        self._reschedule()

    def _share(self) -> None:
        """Progressive filling: the most crowded link fixes its connections' rates first."""
        capacity: dict[tuple[str, int], float] = {}
        members: dict[tuple[str, int], list[_Connection]] = {}
        for flow in self.flows.values():
            for link in (("up", flow.src), ("down", flow.dst)):
                capacity.setdefault(link, self.speeds[link[1]])
                members.setdefault(link, []).append(flow)
        unfixed = set(map(id, self.flows.values()))
        while unfixed:
            share, link = min((capacity[k] / sum(id(f) in unfixed for f in v), k)
                              for k, v in members.items()
                              if any(id(f) in unfixed for f in v))
            for flow in members[link]:
                if id(flow) in unfixed:
                    flow.rate = share
                    unfixed.discard(id(flow))
                    for other in (("up", flow.src), ("down", flow.dst)):
                        capacity[other] -= share
