"""Simulation: the real peers' code (Peer, Trainer, strategies, transport checks) run in
virtual time, many peers in one process (docs/ARCHITECTURE.md, Simulation)."""

from gossip.sim.clock import MeasuredCompute, ModelledCompute, SimClock, parse_compute
from gossip.sim.network import GOODPUT, NetworkModel
from gossip.sim.runner import SimResult, Simulation, simulate_run
from gossip.sim.scheduler import Killed, Scheduler
from gossip.sim.transport import SimTransport, SimWorld

__all__ = ["GOODPUT", "Killed", "MeasuredCompute", "ModelledCompute", "NetworkModel",
           "Scheduler", "SimClock", "SimResult", "SimTransport", "SimWorld", "Simulation",
           "parse_compute", "simulate_run"]
