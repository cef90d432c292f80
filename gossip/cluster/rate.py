"""Link rates as `tc` understands them, validated before any namespace exists."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gossip.errors import ConfigError

# tc's decimal units: "bit" suffixes count bits, "bps" suffixes count bytes per second.
_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)
MIN_BITS = 8_000  # below 1 kB/s every TCP timer fires before a window gets through
MAX_BITS = 10**12

# tbf shaping: the bucket holds BURST_S of traffic (at least BURST_MIN bytes, so a full-size
# frame always fits and fast links are not throttled by timer resolution); packets wait at
# most LATENCY_MS in the queue before tbf drops them, which is what TCP needs to find the rate.
BURST_S = 0.002
BURST_MIN = 16 * 1024
LATENCY_MS = 50


@dataclass(frozen=True)
class Rate:
    """A link rate in bits per second, with the tbf parameters that enforce it."""

    bits: int
    text: str

    @property
    def bytes_per_s(self) -> float:
        return self.bits / 8

    def tbf_args(self, *, burst: int | None = None, latency_ms: float | None = None) -> list[str]:
        """`tc qdisc add ... root` arguments: ``tbf rate R burst B latency L``."""
        burst = burst or max(int(self.bytes_per_s * BURST_S), BURST_MIN)
        latency_ms = latency_ms or LATENCY_MS
        return ["tbf", "rate", f"{self.bits}bit", "burst", str(burst),
                "latency", f"{latency_ms:g}ms"]

    def __str__(self) -> str:
        return self.text


#: Every link of a virtual cluster when no rate is given (``gossip launch --netns``, experiments,
#: ``gossip bench sparse --netns``).
DEFAULT_RATE = "1gbit"


def parse_rate(value: str | int | Rate) -> Rate:
    """``"100mbit"``, ``"1gbit"``, ``"500kbit"``, ``"10mbps"`` (bytes/s) or int bits/s.

    Raises:
        ConfigError: Naming the value and the accepted forms.
    """
    if isinstance(value, Rate):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        bits, text = value, f"{value}bit"
    else:
        match = _RATE.match(value) if isinstance(value, str) else None
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            raise ConfigError(f"rate {value!r}: expected a number and a unit "
                              f"({', '.join(_UNITS)}), e.g. 100mbit, 1gbit, 500kbit")
        bits, text = round(float(match.group(1)) * _UNITS[unit]), value.strip().lower()
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ConfigError(f"rate {value!r}: must be between 8kbit and 1tbit")
    return Rate(bits, text)
