"""Virtual clusters: peers in Linux network namespaces behind bandwidth-capped links."""

from gossip.cluster.iproute import (
    NetnsError,
    NetnsUnavailable,
    check_available,
    unavailable_reason,
)
from gossip.cluster.netns import VirtualCluster
from gossip.cluster.rate import Rate, parse_rate
from gossip.cluster.teardown import cleanup_stale
from gossip.cluster.throughput import Throughput, measure_throughput

__all__ = ["NetnsError", "NetnsUnavailable", "Rate", "Throughput", "VirtualCluster",
           "check_available", "cleanup_stale", "measure_throughput", "parse_rate",
           "unavailable_reason"]
