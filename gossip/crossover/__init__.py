"""Crossover scheduling: jobs that time-share a device take its compute phase in turns,
one computing while the others communicate (docs/ARCHITECTURE.md, Crossover)."""

from gossip.crossover.base import DeviceLock, Hold
from gossip.crossover.connect import DeviceConfig
from gossip.crossover.local import LocalArbiter

__all__ = ["DeviceConfig", "DeviceLock", "Hold", "LocalArbiter"]
