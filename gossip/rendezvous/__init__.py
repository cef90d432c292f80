"""Meeting through a cluster launcher (torchrun, srun, mpirun, Kubernetes) instead of a
topology file listing every host and port: see store.py for the URIs."""

from gossip.rendezvous.launchers import Incarnation
from gossip.rendezvous.store import Rendezvous

__all__ = ["Incarnation", "Rendezvous"]
