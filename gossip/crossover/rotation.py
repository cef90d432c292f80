"""Who gets a device next: the crossover schedule as a pure state machine (no threads, no
sockets, time passed in), shared by the in-process arbiter and the arbiter process.

The jobs active on a device take the compute phase in turns, in one fixed order (by job
name, then rank: several ranks of one job on a device each get a turn) on every device.
``patience_s`` is how long a free device stays reserved for the rank whose turn it is while
it is not yet asking: ``inf`` is strict alternation, 0 a first-come first-served mutex.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossip.errors import ConfigError


@dataclass(frozen=True)
class Request:
    """A job asking for the device for one round's compute phase."""

    job: str
    rank: int
    round: int
    t_request: float  # Unix time


@dataclass(frozen=True)
class Grant:
    """One grant of the device: the JSONL line of the grant log once released."""

    device: str
    job: str
    rank: int
    round: int
    t_request: float
    t_grant: float
    t_release: float | None = None
    revoked: str | None = None  # why the arbiter took it back, if it did

    def as_dict(self) -> dict:
        line = {"device": self.device, "job": self.job, "rank": self.rank, "round": self.round,
                "t_request": self.t_request, "t_grant": self.t_grant,
                "t_release": self.t_release}
        if self.revoked is not None:
            line["revoked"] = self.revoked
        return line


def check_limits(*, patience_s: float, max_hold_s: float) -> None:
    """ConfigError unless ``patience_s`` >= 0 and ``max_hold_s`` > 0 (0 would revoke every
    grant as it is made)."""
    if not patience_s >= 0:
        raise ConfigError(f"patience_s {patience_s}: must be >= 0")
    if not max_hold_s > 0:
        raise ConfigError(f"max_hold_s {max_hold_s}: must be > 0")


Member = tuple[str, int]  # (job, rank): one rank of one job on this device


class Rotation:
    """The schedule of one device. Its members are ranks of jobs, in (job, rank) order: a
    job whose several ranks share the device has a turn per rank, one after the other
    (the order is the same on every device, so the waits still cannot form a cycle).

    Args:
        device: Its name (in grants and errors).
        patience_s: Seconds a free device waits for the member whose turn it is (inf: always).
    """

    def __init__(self, device: str, *, patience_s: float = math.inf):
        if not patience_s >= 0:
            raise ConfigError(f"patience_s must be >= 0, got {patience_s}")
        self.device, self.patience_s = device, patience_s
        self.members: list[Member] = []  # active, sorted: the turn order
        self.waiting: dict[Member, Request] = {}
        self.holder: Grant | None = None
        self.turn: Member | None = None  # whose turn it is while the device is free
        self.last: Member | None = None  # the member whose grant ended last
        self.free_since = 0.0  # Unix time the device became free
        self.granted = 0  # grants so far: before the first, the lowest member goes first

    def join(self, job: str, rank: int) -> None:
        member = (job, rank)
        if member not in self.members:
            self.members = sorted([*self.members, member])
            if not self.granted or self.last not in self.members:
                self.turn = self.members[0]
            else:  # the turn after the last grant, which may now be the newcomer's: a job
                # alone takes turn after turn; one joining then must not wait a whole round
                # (that would leave this device a turn behind the others for the whole run)
                self.turn = self._after(self.last)

    def leave(self, job: str, rank: int, now: float) -> Grant | None:
        """Rank ``rank`` of ``job`` leaves the rotation (it finished or died); returns its
        grant if it held the device (then released at ``now``)."""
        member, released = (job, rank), None
        if self.holds(job, rank):
            released = self.release(job, rank, now)
        self.waiting.pop(member, None)
        if member in self.members:
            if self.turn == member:
                self.turn = self._after(member)
            self.members.remove(member)
            if not self.members:
                self.turn = None
        return released

    def request(self, request: Request) -> None:
        self.join(request.job, request.rank)
        self.waiting[request.job, request.rank] = request

    def holds(self, job: str, rank: int) -> bool:
        """Whether rank ``rank`` of ``job`` holds the device now."""
        return self.holder is not None and (self.holder.job, self.holder.rank) == (job, rank)

    def release(self, job: str, rank: int, now: float, *,
                revoked: str | None = None) -> Grant | None:
        """The holder is done; the turn passes to the next member. Returns the finished
        grant (None if this rank did not hold the device: a stale or forged release)."""
        if not self.holds(job, rank):
            return None
        done = Grant(**{**self.holder.__dict__, "t_release": now, "revoked": revoked})
        self.holder = None
        self.last = (job, rank)
        self.turn = self._after(self.last)
        self.free_since = now
        return done

    def withdraw(self, job: str, rank: int, now: float) -> Grant | None:
        """This rank stops waiting (its acquire timed out): its request is dropped, so the
        device is never granted to nobody; if the grant came meanwhile, it is released."""
        self.waiting.pop((job, rank), None)
        return self.release(job, rank, now)

    def next_grant(self, now: float) -> Grant | None:
        """Grant the device if it is free and someone may have it; the new grant or None."""
        if self.holder is not None or not self.waiting:
            return None
        member = self.turn if self.turn in self.waiting else None
        if member is None and now - self.free_since >= self.patience_s:
            member = min(self.waiting, key=lambda m: (self.waiting[m].t_request, m))
        if member is None:
            return None
        request = self.waiting.pop(member)
        self.granted += 1
        self.holder = Grant(self.device, request.job, request.rank, request.round,
                            request.t_request, t_grant=now)
        return self.holder

    def expire(self, now: float, max_hold_s: float) -> Grant | None:
        """Revoke a grant held past ``max_hold_s`` while another rank waits for the device
        (alone, a holder keeps it): its rank leaves the rotation (it joins again with its
        next request). Returns the revoked grant, if any."""
        holder = self.holder
        if holder is None or not self.waiting or now - holder.t_grant <= max_hold_s:
            return None
        return self.revoke(holder.job, holder.rank, now, f"held past max_hold_s={max_hold_s}")

    def revoke(self, job: str, rank: int, now: float, why: str) -> Grant | None:
        """Take the device from this rank (if it holds it) and the rank out of the rotation;
        the revoked grant, if any."""
        revoked = self.release(job, rank, now, revoked=why)
        self.leave(job, rank, now)
        return revoked

    def blocking(self) -> str:
        """Who keeps the device from the waiting ranks, in words (for timeouts)."""
        if self.holder is not None:
            h = self.holder
            return f"held by job {h.job} rank {h.rank} (round {h.round})"
        if self.turn is None:
            return "free"
        return f"reserved for job {self.turn[0]} rank {self.turn[1]}'s turn"

    def wake_at(self) -> float:
        """When ``next_grant`` may change its mind without any message: the end of the
        turn member's patience (inf: never)."""
        if self.holder is None and self.waiting and self.turn not in self.waiting:
            return self.free_since + self.patience_s
        return math.inf

    def _after(self, member: Member) -> Member | None:
        """The member after ``member`` in the turn order (itself if it is alone)."""
        if not self.members:
            return None
        later = [m for m in self.members if m > member]
        return later[0] if later else self.members[0]
