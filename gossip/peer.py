"""Peer: one rank's transport + strategy, behind ``synchronize`` and ``step``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossip import keys
from gossip.errors import ConfigError
from gossip.strategies import DEFAULT, STRATEGIES, Strategy
from gossip.threads import communication_threads, intra_op_threads, peers_on_this_machine
from gossip.transport import Transport, ZmqTransport
from gossip.transport.zmq import DEAD_AFTER_S

NOTICE_FLUSH_S = 1.0  # see __exit__


class Peer:
    """One rank of a decentralized training job.

    Use as a context manager: entering opens the transport (binds this rank's address),
    leaving says goodbye to the peers it talked to and closes every socket.

    Args:
        rank: This peer's rank in ``topology``.
        topology: A ``gossip.Topology`` naming every peer's address and the graph.
        strategy: A registered strategy's name (``gossip strategies`` lists them and their
            options), a Strategy class of your own, or a factory ``(*, rank, topology,
            transport) -> Strategy``.
        timeout: Seconds to wait for any one message before raising PeerTimeout.
        transport: A transport to use instead of ZeroMQ (e.g. loopback in tests); the Peer
            takes ownership and closes it.
        local_ipc: Reach peers on loopback addresses over Unix sockets instead of TCP, with
            large frames in shared memory (docs/ARCHITECTURE.md, Same-host fast path).
        key_file: This peer's CURVE secret key file, when the topology lists public keys (default:
            ``peer-RANK.key`` in the topology's key directory).
        dead_after: Declare a peer dead once our connection to it has been down this many
            seconds (docs/ARCHITECTURE.md, Dead peers).
        keep_for_rejoin: Keep copies of the last messages sent to each peer, so that a
            neighbour restarted from a checkpoint can rejoin (``rejoin``).
        send_delay: Fault injection: sleep this many seconds before each message of the
            strategy this peer sends (an emulated slow sender).
        comm_threads: torch intra-op threads of a round's communication and math (default:
            this machine's cores divided by the topology's peers on it, at least 1; see
            gossip/threads.py for why more threads than cores stall every peer).
        **options: Strategy options, e.g. ``piece_bytes`` for ring-allreduce; ``compressor``
            may be a compressor's name (with its options, e.g. ``density``) or a Compressor.

    Raises:
        ConfigError: unknown strategy or option, rank not in the topology, or a missing or
            wrong secret key for a topology with keys.
    """

    def __init__(self, rank: int, topology, strategy=DEFAULT, *, timeout: float = 60.0,
                 transport: Transport | None = None, local_ipc: bool = True,
                 key_file: str | Path | None = None, dead_after: float = DEAD_AFTER_S,
                 keep_for_rejoin: bool = False, send_delay: float = 0.0,
                 comm_threads: int | None = None, **options: Any):
        if not 0 <= rank < topology.size:
            raise ConfigError(f"rank {rank} is not in the topology (ranks 0..{topology.size - 1})")
        self._build = STRATEGIES.resolve(strategy, options)  # options checked now
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        if dead_after <= 0:
            raise ConfigError(f"dead_after must be positive, got {dead_after}")
        if not send_delay >= 0:
            raise ConfigError(f"send_delay must be >= 0 seconds, got {send_delay!r}")
        if comm_threads is not None and (not isinstance(comm_threads, int) or comm_threads < 1):
            raise ConfigError(f"comm_threads must be a positive integer, got {comm_threads!r}")
        self.rank = rank
        self.topology = topology
        self.timeout = timeout
        self.transport = transport
        self.local_ipc = local_ipc
        self.dead_after = dead_after
        self.keep_for_rejoin = keep_for_rejoin
        self.send_delay = send_delay
        self.comm_threads = comm_threads or communication_threads(
            peers_on_this_machine(topology, rank))
        # Read now, so a bad key fails before anything binds.
        self.keys = keys.for_rank(topology, rank, key_file) if transport is None else None
        self.strategy: Strategy | None = None
        self.round = 0  # next round used by step()

    def __enter__(self) -> Peer:
        if self.transport is None:
            endpoints = [self.topology.address(r) for r in range(self.topology.size)]
            self.transport = ZmqTransport(self.rank, endpoints, timeout=self.timeout,
                                          local_ipc=self.local_ipc, keys=self.keys,
                                          dead_after=self.dead_after).open()
        if self.keep_for_rejoin:
            self.transport.membership.keep_for_rejoin()
        try:
            self.strategy = self._add(self._build)
            if self.send_delay:
                self.transport.delay_sends(self.send_delay, self.strategy.kinds)
        except BaseException:
            self.transport.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            with self.communicating():  # messages still arriving are decoded and checked
                try:
                    self.strategy.finish()  # e.g. serve neighbours still exchanging
                except BaseException:
                    self.transport.close()
                    raise
                self.transport.shutdown(timeout=min(self.timeout, 10.0))
        else:
            # Error paths close at once (linger 0), except that this peer's notices of dead
            # peers get a moment to leave: without them the others would see this peer die
            # instead and blame it (a cascade of wrong names).
            membership = getattr(self.transport, "membership", None)
            lost = membership is not None and bool(membership.lost)
            self.transport.close(linger=NOTICE_FLUSH_S if lost else 0.0)

    def add_strategy(self, strategy, **options: Any) -> Strategy:
        """Build another strategy on this peer's transport (give it a distinct ``tag``);
        ``strategy`` as for the Peer."""
        return self._add(STRATEGIES.resolve(strategy, options))

    def _add(self, build) -> Strategy:
        strategy = build(rank=self.rank, topology=self.topology, transport=self.transport)
        self.transport.accept_kinds(strategy.kinds,
                                    receiver_checks_finite=strategy.checks_own_result)
        if strategy.needs_every_peer:  # one dead peer stops its rounds everywhere
            self.transport.membership.collective(strategy.kinds)
        return strategy

    def rejoin(self, checkpoint_round: int) -> int:
        """Rejoin the running peers after a restart from the checkpoint of
        ``checkpoint_round``; returns the round to go on from (also ``self.round``).

        A whole job restarted together (every peer rejoining from checkpoints of one round)
        resumes at that round with any strategy; a single peer can rejoin a running job only
        with a strategy that can take it back (``dpsgd``, exact ``matcha``).

        Raises:
            RejoinError: the strategy cannot take a peer back into a running job, the
                restarting peers' checkpoints differ, or the others did not answer in time.
        """
        with self.communicating():
            self.round = self.transport.membership.rejoin(
                checkpoint_round, self.strategy.rejoin_round, timeout=self.timeout)
        return self.round

    @property
    def clock(self):
        """The transport's clock: every time read and sleep of this peer's training."""
        return self.transport.clock

    def note_lost(self, rank: int, round: int, reason: str) -> None:
        """Count ``rank`` as lost since ``round`` on known grounds (e.g. a checkpoint's
        record of the peers lost before a restart)."""
        self.transport.membership.note_lost(rank, round, reason)

    def all_peers_can_meet(self, round: int) -> bool:
        """Whether an exchange among all peers (an all-reduce) can run in ``round``: no peer
        is known lost, and no rejoin abandoned that round."""
        membership = self.transport.membership
        return not membership.lost and round > membership.skip_through

    @property
    def lost_peers(self) -> dict[int, int]:
        """Peers lost so far (dead, or dropped this one), each with the round it was
        noticed in."""
        return {rank: loss.round for rank, loss in sorted(self.transport.membership.lost.items())}

    @property
    def stats(self) -> dict[str, Any]:
        """Exact bytes and message counts so far (header + frames), and seconds spent waiting."""
        return self.transport.stats.snapshot()

    def synchronize(self, tensor: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one round of the strategy on ``tensor``; the result is on its device.

        Every peer must call this with a tensor of the same length and the same ``round``.
        With ``out`` (which may be ``tensor`` itself) the result is written there instead
        of into a new tensor, which saves an allocation per round on large tensors.
        """
        if self.strategy is None:
            raise RuntimeError("Peer is not open: use 'with gossip.Peer(...) as peer:'")
        with self.communicating():
            return self._on_host(tensor.detach(), lambda x, out: self.strategy.synchronize(
                x, round, out=out), out=out)

    @staticmethod
    def _on_host(x: torch.Tensor, run, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run(x, out)`` on a contiguous CPU ``x``; a device tensor is staged through host
        memory and the result comes back on its device."""
        if x.device.type != "cpu":
            result = run(x.cpu().contiguous(), None)
            return result.to(x.device) if out is None else out.copy_(result)
        return run(x.contiguous(), out)

    def communicating(self):
        """Context for work on the communication path outside ``synchronize`` (another
        strategy of this peer): torch runs it on ``comm_threads`` threads."""
        return intra_op_threads(self.comm_threads)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             minibatches: int = 1) -> None:
        """One synchronized optimizer step.

        Gradient strategies average the gradients before ``optimizer.step()``; gossip
        strategies step locally, then mix the parameters with the neighbours.

        Args:
            minibatches: ``.grad`` holds the sum of this many mini-batches' gradients (their
                mean is the step direction). 0: this peer finished none this round (a
                non-blocking strategy stopped it); it still takes part in the exchange.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        if self.strategy.operates_on == "grads":
            with self.communicating():  # flattening and copying back are ours too
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                total = parameters_to_vector(grads)
                averaged = self._on_host(total, lambda x, out: self.strategy.average_gradients(
                    x, minibatches, self.round, out=out))
                for p, g in zip(params, _split_like(averaged, params)):
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
            optimizer.step()
        else:
            if minibatches:  # a peer that finished nothing keeps its parameters as they are
                if minibatches != 1:
                    with torch.no_grad():
                        for p in params:
                            if p.grad is not None:
                                p.grad.mul_(1.0 / minibatches)
                optimizer.step()
            with torch.no_grad(), self.communicating():
                mixed = self.synchronize(parameters_to_vector(params), self.round)
                vector_to_parameters(mixed, params)
        self.round += 1

    def stop_requested(self, round: int) -> bool:
        """Whether to stop computing mini-batches of ``round`` now (``Strategy``)."""
        with self.communicating():  # it may read (and check) whatever messages wait
            return self.strategy.stop_requested(round)

    def computed_all(self, round: int) -> None:
        """Tell the strategy this peer computed every mini-batch of ``round``."""
        with self.communicating():
            self.strategy.computed_all(round)


def _split_like(flat: torch.Tensor, params) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return out
