"""The simulated transport: the Transport of a real run, its frames carried in virtual time.

Everything above ``_send_frames``/``_recv_frames`` is the base class a ZeroMQ peer runs: the
codec encodes and counts the same bytes, and every received message is decoded and checked
(kinds, sizes, ranks, NaN/Inf) as on a socket. Frames are copied at the send, so a receiver
gets private, writable memory and the sender's tensors are free at once.

Dead peers are found as the ZeroMQ transport finds them: a peer we are linked to (sent to,
or connected to by the strategy) whose process has ended without a goodbye is declared dead
once ``dead_after`` virtual seconds have passed since it ended; then the dead-peer handling
of gossip/transport/membership.py runs unchanged.
"""

from __future__ import annotations

from collections import deque
from functools import partial

from gossip.errors import TransportError
from gossip.sim.clock import ModelledCompute, SimClock
from gossip.sim.network import NetworkModel
from gossip.sim.scheduler import Scheduler, Task
from gossip.transport.base import Transport
from gossip.transport.zmq import DEAD_AFTER_S


class SimWorld:
    """What the simulated peers share: the scheduler, the links, every inbox, the deaths.

    Args:
        size: Number of peers.
        network: The network model (default: unlimited links, no latency).
        compute: How the peers' own CPU work is charged (``gossip.sim.clock``).
        threads: torch's intra-op threads in each peer (default: as now).
    """

    def __init__(self, size: int, *, network: NetworkModel | None = None,
                 compute=ModelledCompute(), threads: int | None = None):
        self.size, self.threads = size, threads
        self.scheduler = Scheduler()
        self.links = (network or NetworkModel()).build(self.scheduler, size)
        self.compute = compute
        self.inboxes: list[deque] = [deque() for _ in range(size)]
        self.waiting: list[Task | None] = [None] * size  # the task parked on each inbox
        self.tasks: dict[int, Task] = {}
        self.ended_at: dict[int, float] = {}  # peers whose process ended (killed, crashed)
        self.closed: set[int] = set()

    def transport(self, rank: int, **kwargs) -> SimTransport:
        return SimTransport(rank, self, **kwargs)

    def spawn(self, rank: int, run) -> Task:
        """Run ``run()`` as peer ``rank``'s process; its failure ends it like a crash."""
        task = self.scheduler.spawn(f"peer-{rank}", lambda: self._process(rank, run),
                                    threads=self.threads)
        self.tasks[rank] = task
        return task

    def _process(self, rank: int, run):
        try:
            return run()
        except BaseException:
            self._ended(rank)
            raise

    def kill_at(self, rank: int, when: float) -> None:
        """Kill peer ``rank`` at virtual time ``when`` (a SIGKILL: nothing more leaves it)."""
        self.scheduler.at(when, self._kill, rank)

    def _kill(self, rank: int) -> None:
        task = self.tasks.get(rank)
        if task is None or task.done:
            return
        self._ended(rank)
        self.scheduler.kill(task)

    def _ended(self, rank: int) -> None:
        """``rank``'s process is gone: what is sent to it is lost, and every waiting peer
        looks again when it must judge it dead (SimTransport._poll_liveness)."""
        self.ended_at.setdefault(rank, self.scheduler.now)
        self.closed.add(rank)
        self.inboxes[rank].clear()
        for task in self.waiting:
            if task is not None:
                self.scheduler.wake(task)

    def deliver(self, dst: int, frames: list) -> None:
        if dst in self.closed:
            return  # nobody reads it any more
        self.inboxes[dst].append(frames)
        task = self.waiting[dst]
        if task is not None:
            self.scheduler.wake(task)


class SimTransport(Transport):
    """One simulated peer's transport (see the module docstring).

    Args:
        rank: This peer's rank.
        world: The simulation it belongs to.
        dead_after: Virtual seconds after a linked peer's end before it is declared dead.
        **kwargs: As for ``Transport`` (timeout, kinds, limits); its clock is the world's.
    """

    def __init__(self, rank: int, world: SimWorld, *, dead_after: float = DEAD_AFTER_S,
                 **kwargs):
        if not dead_after > 0:
            raise TransportError(f"dead_after must be > 0 seconds, got {dead_after!r}")
        super().__init__(rank, size=world.size,
                         clock=SimClock(world.scheduler, world.compute), **kwargs)
        self.world, self.dead_after = world, dead_after
        self._judged: set[int] = set()

    def connect(self, ranks) -> None:
        self.linked.update(ranks)

    def _send_frames(self, dst: int, header: bytes, frames: list, track: bool = False,
                     received=()) -> list:
        if self.rank in self.world.closed:
            raise TransportError(f"rank {self.rank}: transport is closed")
        if not 0 <= dst < self.world.size:
            raise TransportError(f"rank {self.rank}: no peer {dst}")
        self.clock.monotonic()  # the CPU used so far is spent before this message leaves
        # A private, writable copy, as a socket delivers; the sender's tensors are free now.
        copy = [bytes(header)] + [bytearray(f.numpy()) for f in frames]
        self.linked.add(dst)
        nbytes = len(header) + sum(f.numel() for f in frames)
        self.world.links.send(self.rank, dst, nbytes, partial(self.world.deliver, dst, copy))
        return []

    def _recv_frames(self, timeout: float) -> list | None:
        inbox = self.world.inboxes[self.rank]
        if not inbox:
            if self._poll_liveness():
                return None  # woken early: what the caller waits for may never come
            now = self.clock.monotonic()  # may run others first (charged compute)
        if inbox:
            return inbox.popleft()
        wake = min(now + timeout, self._next_judgement())
        scheduler = self.world.scheduler
        self.world.waiting[self.rank] = scheduler.current
        try:
            scheduler.park(wake)
        finally:
            self.world.waiting[self.rank] = None
        if inbox:
            return inbox.popleft()
        self._poll_liveness()
        return None

    def _link_up(self, rank: int) -> bool:
        # A simulated process computes in virtual time and is alive until it ends.
        return rank in self.linked and rank not in self.world.closed

    def _suspects(self):
        ended = self.world.ended_at
        if not ended:
            return ()
        # the peers we work with, as ZeroMQ judges them: sent to, connected to or heard from
        return ((rank, when + self.dead_after) for rank, when in ended.items()
                if (rank in self.linked or rank in self.contacts) and rank not in self.departed
                and rank not in self._judged)

    def _next_judgement(self) -> float:
        return min((when for _, when in self._suspects()), default=float("inf"))

    def _poll_liveness(self) -> bool:
        now = self.world.scheduler.now
        dead = sorted(rank for rank, when in self._suspects() if when <= now)
        for rank in dead:
            self._judged.add(rank)
            self.membership.declare_dead(
                rank, f"its connection broke (it exited, crashed or was killed) and did not "
                      f"come back within {self.dead_after:g} s")
        return bool(dead)

    def close(self, linger: float = 0.0) -> None:
        self.world.closed.add(self.rank)
        self.world.inboxes[self.rank].clear()
