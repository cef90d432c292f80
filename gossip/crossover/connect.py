"""A rank's ``DeviceLock`` from an arbiter address, and the ``device:`` section of a run's
config.yaml that names it.

Addresses: ``ipc://PATH`` or ``tcp://HOST:PORT`` (the arbiter process, turns);
``flock:DIR`` (a lock file per device, first come first served); ``slices:DIR`` (naive
co-location: only ``slice_s`` slices of device time hold the lock file).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gossip.clock import REAL_TIME, Clock
from gossip.crossover.address import check_address, check_name
from gossip.crossover.base import DeviceLock
from gossip.errors import ConfigError



@dataclass(frozen=True)
class DeviceConfig:
    """Which device a job's ranks share and through what.

    Attributes:
        arbiter: An address (see the module).
        device: The device's name; ``{rank}`` is replaced by the rank (``dev{rank}``: rank r
            of every job shares device r).
        job: This job's name, distinct among the jobs sharing a device (turns go by name).
        slice_s: With ``slices:``, the slice of device time held at once.
        grant_log: With ``flock:``/``slices:``, where grants are appended (the arbiter
            process keeps its own log).
    """

    arbiter: str
    device: str = "dev{rank}"
    job: str = "job"
    slice_s: float = 0.01
    grant_log: str | None = None

    def __post_init__(self):
        check_address(self.arbiter, what="device: arbiter")
        if not (isinstance(self.slice_s, (int, float)) and 0 < self.slice_s < math.inf):
            raise ConfigError(f"device: slice_s {self.slice_s!r}: must be > 0")
        for key in ("device", "job"):
            check_name(getattr(self, key), what=f"device: {key}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> DeviceConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"{source}: device: unknown field {sorted(unknown)[0]!r}; "
                              f"fields: {', '.join(known)}")
        try:
            return cls(**data)
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def open(self, rank: int, *, timeout: float = 60.0, clock: Clock = REAL_TIME) -> DeviceLock:
        """Rank ``rank``'s lock on its device (the job joins the device's rotation)."""
        device = self.device.replace("{rank}", str(rank))
        if self.arbiter.startswith(("ipc://", "tcp://")):
            from gossip.crossover.client import ArbiterClient

            return ArbiterClient(self.arbiter, device, self.job, rank, timeout=timeout,
                                 clock=clock)
        from gossip.crossover.flock import FlockDevice, SlicedDevice

        scheme, _, directory = self.arbiter.partition(":")
        options: dict[str, Any] = {"timeout": timeout, "clock": clock,
                                   "grant_log": self.grant_log}
        if scheme == "slices":
            return SlicedDevice(Path(directory), device, self.job, rank,
                                slice_s=self.slice_s, **options)
        return FlockDevice(Path(directory), device, self.job, rank, **options)


def device_config(config_path: str | Path | None, *, arbiter: str | None = None,
                  device: str | None = None, job: str | None = None) -> DeviceConfig | None:
    """The ``device:`` section of the YAML at ``config_path``, with the flags given over it;
    None when neither names an arbiter."""
    from gossip.config import load_yaml

    section = dict(load_yaml(config_path).get("device") or {}) if config_path else {}
    for key, value in (("arbiter", arbiter), ("device", device), ("job", job)):
        if value is not None:
            section[key] = value
    if not section:
        return None
    if "arbiter" not in section:
        raise ConfigError("--device/--job need --arbiter (or a device: arbiter key)")
    return DeviceConfig.from_dict(section, source=str(config_path or "command line"))
