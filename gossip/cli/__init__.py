"""Command line: `gossip peer | launch | simulate | arbiter | crossover | experiment run | plot | topology show
| keys | bench | strategies | compressors`.

One module per command family; importing them registers their commands on ``main``.
"""

from gossip.cli import (  # noqa: F401  (register commands)
    arbiter,
    bench,
    crossover,
    experiment,
    simulate,
    strategies,
    topology,
    train,
)
from gossip.cli.common import main

__all__ = ["main"]
