"""Who gets a device next: the crossover schedule as a pure state machine (no threads, no
sockets, time passed in), shared by the in-process arbiter and the arbiter process.

The jobs active on a device take the compute phase in turns, in one fixed order (by job
name) on every device. ``patience_s`` is how long a free device stays reserved for the job
whose turn it is while that job is not yet asking: ``inf`` is strict alternation, 0 a
first-come first-served mutex.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


class Rotation:
    """The schedule of one device.

    Args:
        device: Its name (in grants and errors).
        patience_s: Seconds a free device waits for the job whose turn it is (inf: always).
    """

    def __init__(self, device: str, *, patience_s: float = math.inf):
        if not patience_s >= 0:
            raise ValueError(f"patience_s must be >= 0, got {patience_s}")
        self.device, self.patience_s = device, patience_s
        self.jobs: list[str] = []  # active, sorted: the turn order
        self.waiting: dict[str, Request] = {}
        self.holder: Grant | None = None
        self.turn: str | None = None  # whose turn it is while the device is free
        self.last: str | None = None  # the job whose grant ended last
        self.free_since = 0.0  # Unix time the device became free
        self.granted = 0  # grants so far: before the first, the lowest job goes first

    def join(self, job: str) -> None:
        if job not in self.jobs:
            self.jobs = sorted([*self.jobs, job])
            if not self.granted or self.last not in self.jobs:
                self.turn = self.jobs[0]
            else:  # the turn after the last grant, which may now be the newcomer's: a job
                # alone takes turn after turn; one joining then must not wait a whole round
                # (that would leave this device a turn behind the others for the whole run)
                self.turn = self._after(self.last)

    def leave(self, job: str, now: float) -> Grant | None:
        """``job`` leaves the rotation (it finished or died); returns its grant if it held
        the device (then released at ``now``)."""
        released = None
        if self.holder is not None and self.holder.job == job:
            released = self.release(job, now)
        self.waiting.pop(job, None)
        if job in self.jobs:
            if self.turn == job:
                self.turn = self._after(job)
            self.jobs.remove(job)
            if not self.jobs:
                self.turn = None
        return released

    def request(self, request: Request) -> None:
        self.join(request.job)
        self.waiting[request.job] = request

    def release(self, job: str, now: float, *, revoked: str | None = None) -> Grant | None:
        """The holder ``job`` is done; the turn passes to the next job. Returns the finished
        grant (None if ``job`` did not hold the device: a stale or forged release)."""
        if self.holder is None or self.holder.job != job:
            return None
        done = Grant(**{**self.holder.__dict__, "t_release": now, "revoked": revoked})
        self.holder = None
        self.last, self.turn = job, self._after(job)
        self.free_since = now
        return done

    def withdraw(self, job: str, now: float) -> Grant | None:
        """``job`` stops waiting (its acquire timed out): its request is dropped, so the
        device is never granted to nobody; if the grant came meanwhile, it is released."""
        self.waiting.pop(job, None)
        return self.release(job, now)

    def next_grant(self, now: float) -> Grant | None:
        """Grant the device if it is free and someone may have it; the new grant or None."""
        if self.holder is not None or not self.waiting:
            return None
        job = self.turn if self.turn in self.waiting else None
        if job is None and now - self.free_since >= self.patience_s:
            job = min(self.waiting.values(), key=lambda r: (r.t_request, r.job)).job
        if job is None:
            return None
        request = self.waiting.pop(job)
        self.granted += 1
        self.holder = Grant(self.device, job, request.rank, request.round, request.t_request,
                            t_grant=now)
        return self.holder

    def expire(self, now: float, max_hold_s: float) -> Grant | None:
        """Revoke a grant held past ``max_hold_s``: its job leaves the rotation. Returns
        the revoked grant, if any."""
        holder = self.holder
        if holder is None or now - holder.t_grant <= max_hold_s:
            return None
        revoked = self.release(holder.job, now, revoked=f"held past max_hold_s={max_hold_s}")
        self.leave(holder.job, now)
        return revoked

    def blocking(self) -> str:
        """Who keeps the device from the waiting jobs, in words (for timeouts)."""
        if self.holder is not None:
            h = self.holder
            return f"held by job {h.job} rank {h.rank} (round {h.round})"
        return f"reserved for job {self.turn}'s turn" if self.turn else "free"

    def wake_at(self) -> float:
        """When ``next_grant`` may change its mind without any message: the end of the
        turn job's patience (inf: never)."""
        if self.holder is None and self.waiting and self.turn not in self.waiting:
            return self.free_since + self.patience_s
        return math.inf

    def _after(self, job: str) -> str | None:
        """The job after ``job`` in the turn order (itself if it is alone)."""
        if not self.jobs:
            return None
        later = [j for j in self.jobs if j > job]
        return later[0] if later else self.jobs[0]
