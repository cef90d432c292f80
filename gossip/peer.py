"""Peer: one rank's transport + strategy, behind ``synchronize`` and ``step``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from gossip import keys, same_start
from gossip.attacks import Attack, Attacker
from gossip.device import HostStaging
from gossip.errors import ConfigError, PeerNotOpen, TransportBusy
from gossip.matrix import check, topology_modes
from gossip.overlap import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB
from gossip.rendezvous import Rendezvous
from gossip.rendezvous.meet import Locator, meet, transport_args
from gossip.stepping import LocalStep, Stepper
from gossip.strategies import DEFAULT, STRATEGIES, Strategy
from gossip.strategies.elastic import ElasticRounds
from gossip.strategies.elastic_gossip import ElasticGossip
from gossip.threads import communication_threads, intra_op_threads, peers_on_this_machine
from gossip.transport import DEAD_AFTER_S, TIMEOUT_S, Transport, ZmqTransport

NOTICE_FLUSH_S = 1.0  # see __exit__


class Peer:
    """One rank of a decentralized training job.

    Use as a context manager: entering opens the transport (binds this rank's address),
    leaving says goodbye to the peers it talked to and closes every socket.

    Args:
        rank: This peer's rank in ``topology``.
        topology: A ``gossip.Topology`` naming every peer's address and the graph.
        strategy: A registered strategy's name (``gossip strategies`` lists them and their
            options), a Strategy class of your own, a factory ``(*, rank, topology,
            transport) -> Strategy``, or a ``STRATEGIES.resolve`` spec (``TrainConfig.spec``).
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
        attack: Fault injection: this peer attacks (a ``gossip.attacks.Attack``): its
            strategy's messages carry the attack's payloads instead of its model.
        comm_threads: torch intra-op threads of a round's communication and math (default:
            this machine's cores divided by the topology's peers on it, at least 1; see
            gossip/threads.py for why more threads than cores stall every peer).
        rendezvous: Meet the other peers through a cluster launcher's store instead of at
            the topology's addresses: a URI (``env://``, ``slurm://``, ``tcp://HOST:PORT``,
            ``file:///PATH``) or a ``gossip.rendezvous.Rendezvous``. This peer binds an
            ephemeral port and publishes it; ``topology`` then needs the right size and
            graph only (its addresses become the peers' on entering).
        elastic: Survive deaths (an all-peer strategy that declares ``survives_death``):
            the survivors agree on a view of the members without the dead peer and go on
            (gossip/strategies/elastic.py); a gossip strategy that declares
            ``mixes_on_views`` rebuilds its graph on each view of the members
            (gossip/strategies/elastic_gossip.py); others refuse it.
        min_peers: In an elastic run, fewer members than this end it (PeerGone).
        spares: In an elastic run, the topology's last ``spares`` ranks are not members at
            first: peers started on them join the running ones (``enter``). With a
            rendezvous they follow the launcher's peers, and a joiner's rank is a fresh id
            from its store (``Rendezvous.next_id``).
        **options: Strategy options, e.g. ``piece_bytes`` for ring-allreduce; ``compressor``
            may be a compressor's name (with its options, e.g. ``density``) or a Compressor.

    Raises:
        ConfigError: unknown strategy or option, rank not in the topology, a missing or
            wrong secret key for a topology with keys, or ``elastic`` with a strategy that
            cannot survive a death.
    """

    def __init__(self, rank: int, topology, strategy=DEFAULT, *, timeout: float = TIMEOUT_S,
                 transport: Transport | None = None, local_ipc: bool = True,
                 key_file: str | Path | None = None, dead_after: float = DEAD_AFTER_S,
                 keep_for_rejoin: bool = False, send_delay: float = 0.0,
                 comm_threads: int | None = None, rendezvous=None, attack: Attack | None = None,
                 elastic: bool = False, min_peers: int = 1, spares: int = 0, **options: Any):
        if not 0 <= rank < topology.size:
            raise ConfigError(f"rank {rank} is not in the topology (ranks 0..{topology.size - 1})")
        # The strategy's options parsed once, here, and the matrix checked now (overlap
        # builds one more strategy per bucket from this spec).
        self.builder = STRATEGIES.resolve(strategy, options)
        check(self.builder, None, topology_modes(topology) | ({"elastic"} if elastic else set()))
        if not isinstance(min_peers, int) or not 1 <= min_peers <= topology.size:
            raise ConfigError(f"min_peers must be an integer in 1..{topology.size} (the "
                              f"topology's peers), got {min_peers!r}")
        if not isinstance(spares, int) or not 0 <= spares < topology.size \
                or spares and not elastic:
            raise ConfigError(f"spares must be an integer in 0..{topology.size - 1} (the "
                              f"topology's peers less one), with elastic, got {spares!r}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        if dead_after <= 0:
            raise ConfigError(f"dead_after must be positive, got {dead_after}")
        if not send_delay >= 0:
            raise ConfigError(f"send_delay must be >= 0 seconds, got {send_delay!r}")
        if comm_threads is not None and (not isinstance(comm_threads, int) or comm_threads < 1):
            raise ConfigError(f"comm_threads must be a positive integer, got {comm_threads!r}")
        if attack is not None and not isinstance(attack, Attack):
            raise ConfigError(f"attack must be a gossip.attacks.Attack, got {attack!r}")
        self.attack = None if attack is None else attack.resolved(rank, topology.size)
        self.elastic, self.min_peers, self.spares = elastic, min_peers, spares
        self.leave_requested = False  # request_leave: the training loop leaves after its round
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
        self._threads_given = comm_threads is not None
        if isinstance(rendezvous, str):
            rendezvous = Rendezvous.parse(rendezvous, timeout=timeout)
        self.rendezvous = rendezvous
        # Read now, so a bad key fails before anything binds.
        self.keys = keys.for_rank(topology, rank, key_file) if transport is None else None
        self.strategy: Strategy | None = None
        self.round = 0  # next round used by step()
        self._stepper: Stepper = LocalStep(self)  # attach() replaces it
        self._staging = HostStaging()  # device tensors' host buffers, kept across rounds

    def __enter__(self) -> Peer:
        if self.transport is None and self.rendezvous is not None:
            self._meet()
        elif self.transport is None:
            endpoints = [self.topology.address(r) for r in range(self.topology.size)]
            self.transport = ZmqTransport(self.rank, endpoints, timeout=self.timeout,
                                          local_ipc=self.local_ipc, keys=self.keys,
                                          dead_after=self.dead_after).open()
        if self.keep_for_rejoin:
            self.transport.membership.keep_for_rejoin()
        if self.elastic:
            self.transport.membership.elastic(
                self.min_peers, self.spares, locate=None if self.rendezvous is None else
                Locator(self.rendezvous, self.transport, self.topology.size - self.spares))
        if self.attack is not None:
            self.transport = Attacker(self.transport, self.attack, self.topology)
        try:
            self.strategy = self._add(self.builder)
            if self.attack is not None:
                self.transport.aim(self.strategy)
            if self.send_delay:
                self.transport.delay_sends(self.send_delay, self.strategy.kinds)
        except BaseException:
            self.transport.close()
            raise
        return self

    def _meet(self) -> None:
        """Bind an ephemeral port, publish it through the rendezvous, learn the others'."""
        transport = ZmqTransport(self.rank, timeout=self.timeout, local_ipc=self.local_ipc,
                                 keys=self.keys, dead_after=self.dead_after,
                                 **transport_args(self.rendezvous, self.rank, self.topology.size))
        self.topology = meet(self.rendezvous, self.rank, self.topology, transport,
                             spares=self.spares)
        self.transport = transport
        if not self._threads_given:  # now that we know who shares this machine
            self.comm_threads = communication_threads(
                peers_on_this_machine(self.topology, self.rank))

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._close(exc_type)
        finally:
            if self.rendezvous is not None:
                self.rendezvous.close(self.rank, self.topology.size - self.spares,
                                      wait=exc_type is None)

    def _close(self, exc_type) -> None:
        # An overlap's thread ends before the goodbye (or the close); what is left to do
        # (serving, finishing) runs on this thread.
        self._stepper.close(timeout=None if exc_type is None else min(self.timeout, 5.0))
        self._stepper = LocalStep(self)
        if exc_type is None:
            with self.communicating():  # messages still arriving are decoded and checked
                try:
                    self.serve()
                    self.strategy.finish()  # e.g. serve neighbours still exchanging
                    self._staging.write_back()  # the moves finish made, to the caller's tensor
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

    def serve(self) -> None:
        """Do the work this peer owes the others after its own rounds: a parameter
        server's serve loop, answering until every worker said goodbye (a server-only rank
        runs only this). Leaving the ``with`` block runs it too; nothing for strategies
        without server work."""
        if self.strategy is None:
            raise PeerNotOpen("Peer is not open: use 'with gossip.Peer(...) as peer:'")
        with self.communicating():
            self.strategy.serve()

    def add_strategy(self, strategy, **options: Any) -> Strategy:
        """Build another strategy on this peer's transport (give it a distinct ``tag``);
        ``strategy`` as for the Peer."""
        return self._add(STRATEGIES.resolve(strategy, options))

    def _add(self, build) -> Strategy:
        self._check_transport_free("add a strategy")
        strategy = build(rank=self.rank, topology=self.topology, transport=self.transport)
        if self.elastic and self.strategy is None:  # the run's strategy, not a probe's
            # a factory's capabilities are known only now
            wrapper = (ElasticRounds if getattr(strategy, "survives_death", False) else
                       ElasticGossip if getattr(strategy, "mixes_on_views", False) else None)
            if wrapper is None:
                raise ConfigError(f"--elastic with strategy {type(strategy).__name__}: it "
                                  f"declares neither survives_death nor mixes_on_views")
            strategy = wrapper(strategy, self.transport.membership.epochs,
                               timeout=self.timeout)
        self.transport.accept_kinds(strategy.kinds,
                                    receiver_checks_finite=strategy.checks_own_result)
        if strategy.needs_every_peer:  # one dead peer stops its rounds everywhere
            self.transport.membership.collective(strategy.kinds)
            same_start.expect(self.transport)  # its check before round 0 (same_start.py)
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
            moved = self.transport.endpoints[self.rank] if self.rendezvous else None
            self.round = self.transport.membership.rejoin(
                checkpoint_round, self.strategy.rejoin_round, timeout=self.timeout,
                endpoint=moved)
        return self.round

    def request_leave(self) -> None:
        """Ask the training loop to leave after the round under way (safe from a signal
        handler: it only sets ``leave_requested``)."""
        self.leave_requested = True

    def leave(self) -> None:
        """Leave the run after the rounds this peer completed, without being counted dead:
        in an elastic run the others agree on a view without it from the next round; gossip
        strategies drop it at its goodbye (leaving the ``with`` block says it). Then leave
        the ``with`` block."""
        if self.strategy is None:
            raise PeerNotOpen("Peer is not open: use 'with gossip.Peer(...) as peer:'")
        if self.elastic:
            with self.communicating():
                self.strategy.leave()

    def enter(self) -> tuple[int, bytes] | None:
        """On a spare rank of an elastic run: join the running members; returns the round
        to run from (also ``self.round``) and the state its donor handed over, or None if
        the members ended the run before admitting this peer, or if it was asked to leave
        (``request_leave``) before a view admitted it."""
        if not self.elastic or self.rank < self.topology.size - self.spares:
            raise ConfigError(f"rank {self.rank} cannot join: only the last {self.spares} "
                              f"rank(s) of an elastic run's topology (spares) join it")
        with self.communicating():
            entered = self.strategy.enter(stop=lambda: self.leave_requested)
        if entered is not None:
            self.round = entered[0]
        return entered

    def hand_over(self, round: int, state) -> list[int]:
        """In an elastic run, after completing ``round``: send ``state()`` (bytes) to the
        peers joining at the next round that this peer is the donor of; returns them."""
        if not self.elastic:
            return []
        with self.communicating():
            return self.strategy.hand_over(round, state)

    @property
    def clock(self):
        """The transport's clock: every time read and sleep of this peer's training."""
        return self.transport.clock

    def note_lost(self, rank: int, round: int, reason: str) -> None:
        """Count ``rank`` as lost since ``round`` on known grounds (e.g. a checkpoint's
        record of the peers lost before a restart)."""
        self.transport.membership.note_lost(rank, round, reason)

    def all_peers_can_meet(self, round: int) -> bool:
        """Whether an exchange among all peers (an all-reduce; in an elastic run, all the
        view's members) can run in ``round``: no peer is known lost, no member left before
        it, and no rejoin abandoned that round."""
        membership = self.transport.membership
        present = membership.epochs is None or not membership.epochs.gone_for(round)
        return not membership.lost and round > membership.skip_through and present

    @property
    def view(self):
        """In an elastic run, the view of the members this peer runs on now
        (``gossip.transport.epochs.View``); None otherwise."""
        epochs = self.transport.membership.epochs
        return None if epochs is None else epochs.view

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
            raise PeerNotOpen("Peer is not open: use 'with gossip.Peer(...) as peer:'")
        with self.communicating():
            return self.on_host(tensor.detach(), lambda x, out: self.strategy.synchronize(
                x, round, out=out), out=out)

    def on_host(self, x: torch.Tensor, run, out: torch.Tensor | None = None) -> torch.Tensor:
        """``run(x, out)`` on a contiguous CPU ``x`` (a strategy's round, for the steppers);
        a device tensor is staged through a host buffer kept for the next rounds and the
        result comes back on its device."""
        return self._staging.run(x, run, out, kept=self.strategy.keeps_tensor)

    def communicating(self):
        """Context for work on the communication path outside ``synchronize`` (another
        strategy of this peer): torch runs it on ``comm_threads`` threads.

        Raises:
            TransportBusy: the communication thread of ``attach`` has work queued.
        """
        self._check_transport_free("use the transport")
        return intra_op_threads(self.comm_threads)

    def _check_transport_free(self, what: str) -> None:
        if self._stepper.busy:
            raise TransportBusy(f"rank {self.rank}: cannot {what} while the communication "
                                f"thread synchronizes round {self.round} (call peer.step "
                                f"first)")

    # -- overlap ---------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, *, bucket_mb: float = DEFAULT_BUCKET_MB,
               first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB) -> None:
        """Overlap ``model``'s synchronization with its computation from now on; then train
        as usual (``loss.backward(); peer.step(model, optimizer)``).

        Gradient strategies average buckets of about ``bucket_mb`` MiB (the first one
        ``first_bucket_mb``; ``inf``: one bucket) on a communication thread as backward
        produces them; parameter strategies mix the round's snapshot during forward and
        backward and add the local step to it (combine-then-adapt). Until ``step`` has
        waited for the thread, anything else that would use the transport raises
        ``TransportBusy``. See docs/ARCHITECTURE.md, Overlap.

        Raises:
            ConfigError: the strategy decides its combine point at run time
                (``nonblocking``), a bad bucket size, a model already attached, or its
                parameters of several dtypes or devices.
        """
        if self.strategy is None:
            raise PeerNotOpen("Peer is not open: use 'with gossip.Peer(...) as peer:'")
        self._stepper = self._stepper.attach(model, bucket_mb=bucket_mb,
                                             first_bucket_mb=first_bucket_mb)

    def no_sync(self) -> AbstractContextManager[None]:
        """Inside: backward accumulates gradients without synchronizing them (mini-batches
        of one step; the last one's backward runs outside)."""
        return self._stepper.no_sync()

    def overlap_metrics(self) -> dict[str, Any] | None:
        """With a model attached: seconds waited in the last steps (``exposed_comm_s``), the
        thread's busy seconds (``comm_busy_s``) and ``buckets``, reset by the call."""
        return self._stepper.metrics()

    def strategy_state(self) -> dict[str, Any]:
        """The strategy state a checkpoint keeps (with a model attached: one per bucket)."""
        return self._stepper.state_dict()

    def load_strategy_state(self, state) -> None:
        """Restore what ``strategy_state`` returned."""
        self._stepper.load_state_dict(state)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             minibatches: int | None = None) -> None:
        """One synchronized optimizer step.

        Gradient strategies average the gradients before ``optimizer.step()``; parameter
        strategies step, then synchronize parameters and float buffers (``LocalStep``).
        With a model attached (``attach``) this waits for the communication thread instead.

        Args:
            minibatches: ``.grad`` holds the sum of this many mini-batches' gradients (their
                mean is the step direction); default 1, or with a model attached the
                training forward passes since the last step. 0: this peer finished none
                this round (a non-blocking strategy stopped it); it still takes part in the
                exchange.
        """
        self._stepper.step(model, optimizer, minibatches)
        self.round += 1

    def stop_requested(self, round: int) -> bool:
        """Whether to stop computing mini-batches of ``round`` now (``Strategy``)."""
        return self._stepper.stop_requested(round)

    def computed_all(self, round: int) -> None:
        """Tell the strategy this peer computed every mini-batch of ``round``."""
        self._stepper.computed_all(round)

