"""Command line: `gossip peer | launch | experiment run | plot | topology show | keys | bench`.

One module per command family; importing them registers their commands on ``main``.
"""

from gossip.cli import bench, experiment, topology, train  # noqa: F401  (register commands)
from gossip.cli.common import main

__all__ = ["main"]
