"""`gossip peer --rendezvous`: rank, size and topology from the launcher, the run directory's
files written once the peers met, and the round a restarted job resumes at."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from gossip import checkpoint
from gossip.errors import ConfigError
from gossip.rendezvous.launchers import require_rank
from gossip.rendezvous.restart import common_round
from gossip.rendezvous.store import Rendezvous
from gossip.topology import Topology


@dataclass(frozen=True)
class Meeting:
    """How one `gossip peer` finds the others: a rendezvous, or the topology file's
    addresses (``rendezvous`` None, the ``static`` default)."""

    rendezvous: Rendezvous | None
    rank: int
    size: int | None  # the launcher's; None: the topology file's
    spares: int = 0  # ids after the launcher's size, for peers joining through the store

    @classmethod
    def parse(cls, uri: str, rank: int | None, *, advertise: str | None, timeout: float,
              join: bool = False, spares: int = 0) -> Meeting:
        """With ``join`` (an elastic run's joiner) the store gives the rank: a fresh id
        after the job's members (``Rendezvous.next_id``).

        Raises:
            ConfigError: a bad URI, a rank or size nobody gave, or ``--rank`` with a join
                through the store.
            RendezvousError: the store has no join id left.
        """
        if uri == "static":
            if advertise:
                raise ConfigError("--advertise: only with --rendezvous (a static topology "
                                  "names every peer's address)")
            return cls(None, require_rank(os.environ) if rank is None else rank, None)
        rendezvous = Rendezvous.parse(uri, advertise=advertise, timeout=timeout)
        if not join:
            return cls(rendezvous, rendezvous.rank_of(rank), rendezvous.size_of(), spares)
        if rank is not None:
            raise ConfigError(f"--rank {rank}: not with --join through a rendezvous (the "
                              f"store gives a joiner a fresh id)")
        members = rendezvous.members()
        return cls(rendezvous, rendezvous.next_id(members, spares), members, spares)

    def topology(self, path: str | Path) -> Topology:
        """The topology file's (a graph-only file takes the launcher's size).

        Raises:
            ConfigError: the file's peers (or an edge list's ranks) are not the launcher's
                size, naming where that size came from (e.g. ``$WORLD_SIZE``).
        """
        size = None if self.size is None else self.size + self.spares
        topology = Topology.from_yaml(path, size=size)
        if size is not None and topology.size != size:
            spare = f" and {self.spares} spare id(s)" if self.spares else ""
            raise ConfigError(f"{path}: {topology.size} peers (ranks 0..{topology.size - 1}), "
                              f"but the launcher started {self.size}{spare} "
                              f"({self.rendezvous.size_origin()})")
        return topology

    @property
    def restarted(self) -> bool:
        """A later incarnation of a job its launcher restarted whole."""
        return self.rendezvous is not None and self.rendezvous.incarnation.restart > 0

    def settle(self, node, run_dir: str | Path, config, checkpoint_path) -> int | None:
        """Once the peers met: rank 0 writes the resolved topology and the config into the
        run directory (for resume and plots, as `gossip launch` does); a restarted job
        agrees on the checkpoint round to resume at (None: start afresh or as asked)."""
        if self.rendezvous is None:
            return None
        if node.rank == 0:
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            _write(run_dir / "topology.yaml", node.topology.to_dict())
            _write(run_dir / "config.yaml", {"train": config.to_dict(),
                                             "topology": node.topology.to_dict(),
                                             "ranks": list(range(node.topology.size))})
        if not self.restarted or node.rank >= self.size:  # a joiner resumes nothing
            return None
        kept = checkpoint.generations(checkpoint_path, rank=node.rank,
                                      strategy=config.strategy, task=config.task)
        return common_round(self.rendezvous, node.rank, self.size, kept)


def _write(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    os.replace(tmp, path)
