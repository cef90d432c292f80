"""The grant log: one JSON line per grant of a device (device, job, rank, round,
t_request, t_grant, t_release, all times Unix), and the checks a log must pass."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gossip.crossover.rotation import Grant, Rotation
from gossip.errors import ConfigError

log = logging.getLogger("gossip.crossover")


class GrantLog:
    """Appends grants to ``path`` (None: nowhere). Each line is one ``write`` to a file
    opened for appending, so several processes may share one log."""

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else Path(path)
        self._lock = threading.Lock()
        if self.path is not None:  # a log that cannot be written fails now, not at a release
            try:
                self._append(b"")
            except OSError as exc:
                raise ConfigError(f"grant log {self.path}: {exc.strerror}") from None

    def write(self, grant: Grant | None) -> None:
        """Append ``grant``'s line; a failure is logged (the arbiter keeps granting)."""
        if self.path is None or grant is None:
            return
        try:
            self._append((json.dumps(grant.as_dict()) + "\n").encode())
        except OSError as exc:
            log.warning("grant log %s: a grant's line was lost: %s", self.path, exc.strerror)

    def _append(self, data: bytes) -> None:
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def expire(self, rotation: Rotation, now: float, max_hold_s: float) -> Grant | None:
        """Revoke ``rotation``'s grant if held past ``max_hold_s``: a warning, a line; the
        revoked grant (None: none)."""
        revoked = rotation.expire(now, max_hold_s)
        if revoked is not None:
            log.warning("device %s: revoked job %s rank %d's grant of round %d: %s",
                        revoked.device, revoked.job, revoked.rank, revoked.round,
                        revoked.revoked)
            self.write(revoked)
        return revoked


def read_grants(path: str | Path) -> list[dict[str, Any]]:
    """The grants of a log, in the order they were written."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def overlaps(grants: Iterable[Mapping[str, Any]]) -> list[tuple[dict, dict]]:
    """Pairs of grants of one device whose [t_grant, t_release] intervals overlap."""
    by_device = defaultdict(list)
    for g in grants:
        by_device[g["device"]].append(dict(g))
    bad = []
    for device_grants in by_device.values():
        device_grants.sort(key=lambda g: g["t_grant"])
        for a, b in zip(device_grants, device_grants[1:]):
            if b["t_grant"] < a["t_release"]:
                bad.append((a, b))
    return bad


def turn_breaks(grants: Iterable[Mapping[str, Any]], jobs: Iterable[str]) -> int:
    """How often, on any device, a job of ``jobs`` got the device twice in a row while they
    all ran there: after each one's first grant, before any one's last (a job alone before
    the others joined or after they left has the device to itself)."""
    jobs = set(jobs)
    by_device = defaultdict(list)
    for g in grants:
        if g["job"] in jobs:
            by_device[g["device"]].append(g)
    breaks = 0
    for device_grants in by_device.values():
        device_grants.sort(key=lambda g: g["t_grant"])
        order = [g["job"] for g in device_grants]
        if set(order) != jobs:
            continue
        first = max(order.index(j) for j in jobs)
        last = min(len(order) - 1 - order[::-1].index(j) for j in jobs)
        breaks += sum(a == b for a, b in zip(order[first:last], order[first + 1:last + 1]))
    return breaks
