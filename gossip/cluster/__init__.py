"""Virtual clusters: peers in Linux network namespaces behind bandwidth-capped links."""

from gossip.cluster.netns import (
    NetnsError,
    NetnsUnavailable,
    VirtualCluster,
    check_available,
    cleanup_stale,
    unavailable_reason,
)
from gossip.cluster.rate import Rate, parse_rate
from gossip.cluster.throughput import Throughput, measure_throughput

__all__ = ["NetnsError", "NetnsUnavailable", "Rate", "Throughput", "VirtualCluster",
           "check_available", "cleanup_stale", "measure_throughput", "parse_rate",
           "unavailable_reason"]
