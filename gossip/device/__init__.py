"""Device tensors through a CPU socket library: a pinned host pool allocated once, copies on
a side stream with events, pieces pipelined with the sends (see docs/ARCHITECTURE.md)."""

from gossip.device.copier import Copier, CudaCopier, HostCopier, copier_for
from gossip.device.pipeline import pipelined
from gossip.device.pool import HostPool
from gossip.device.staging import HostStaging

__all__ = ["Copier", "CudaCopier", "HostCopier", "HostPool", "HostStaging", "copier_for",
           "pipelined"]
