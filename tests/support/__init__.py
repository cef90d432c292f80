"""Helpers for gossip's tests, importable from any test file (``from support import ...``;
``tests`` is on the path through setup.cfg's ``pythonpath``). tests/conftest.py only wraps
some of them as fixtures.

One job per module: peers (peers as threads, rounds over ZeroMQ or loopback), oracle
(float64 reference results, input data), training (Peer.step on a tiny model), logs
(rejection reasons), waiting (event waits with deadlines), leaks (what a test left behind), launching (`gossip launch` with a peer killed), hostile (a stranger and a
neighbour that attack a peer over ZeroMQ).
"""

from support.hostile import Neighbour, stranger_send
from support.launching import launch_and_kill, pid_of_rank
from support.logs import Reasons, rejection_reasons
from support.oracle import TOLERANCE, Oracle, assert_same, peer_data
from support.peers import (Rounds, assert_balanced, iterate_on_peers, make_local_topology,
                           open_peer, peer_once_all_bound, run_in_threads,
                           run_on_transports, run_rounds_on_peers)
from support.training import BatchNormNet, Steps, TinyNet, run_training_steps
from support.waiting import read_until, wait_connected, wait_until

__all__ = [
    "TOLERANCE", "BatchNormNet", "Neighbour", "Oracle", "Reasons", "Rounds", "Steps", "TinyNet",
    "assert_balanced", "assert_same", "iterate_on_peers", "launch_and_kill",
    "make_local_topology", "open_peer", "peer_data", "peer_once_all_bound", "pid_of_rank",
    "read_until", "rejection_reasons", "run_in_threads", "run_on_transports", "run_rounds_on_peers",
    "run_training_steps", "stranger_send", "wait_connected", "wait_until",
]
