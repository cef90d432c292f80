"""The local training loop of one peer: a ``Trainer`` with one method per phase of a round
(compute, synchronize, record, probe, checkpoint), and ``train``, its entry point.

Every time read and sleep goes through ``peer.clock``, so a transport that runs peers in
virtual time runs this same loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gossip import checkpoint as checkpoints
from gossip.config import TrainConfig
from gossip.errors import CheckpointError
from gossip.metrics import MetricsWriter
from gossip.peer import Peer
from gossip.tasks import BatchStream, create_task, evaluate, partition
from gossip.tasks.emulated import emulate_device
from gossip.training.asynchronous import AsyncRunner
from gossip.training.consensus import ConsensusProbe, algorithm_bytes
from gossip.training.records import Record, lines_before, state_hash
from gossip.transport.state_bytes import state_from_bytes, state_to_bytes

log = logging.getLogger("gossip.training")
# torch's global RNG is shared by the threads of a process (peers run as threads in tests):
# seeding and initializing must not interleave, or peers start from different models.
_INIT_LOCK = threading.Lock()


@dataclass(frozen=True)
class Work:
    """What the compute phase of a round did."""

    minibatches: int  # finished
    loss_sum: float  # over those mini-batches
    delay_s: float  # injected
    seconds: float  # the whole phase, injected delays included


class Trainer:
    """One peer's training: the task, its model, data shard and optimizer, and the phases of
    a round. Build it on an open peer, optionally ``resume()``, then ``run()``.

    Args:
        peer: An open peer; its clock times everything.
        config: The run's settings.
        model: Train this model in place instead of a fresh one (the caller must give every
            peer the same initial weights).
        checkpoint_path: This peer's checkpoint file (written with
            ``config.checkpoint_every``, read by ``resume``).
        metrics: Where each round's record goes.
        on_round: Called with each record as a dict (its JSONL line).
        on_minibatch: Called as ``(round, finished)`` after each mini-batch.
    """

    def __init__(self, peer: Peer, config: TrainConfig, *, model: torch.nn.Module | None = None,
                 checkpoint_path: str | Path | None = None,
                 metrics: MetricsWriter | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None,
                 on_minibatch: Callable[[int, int], None] | None = None):
        self.peer, self.config, self.clock = peer, config, peer.clock
        self.checkpoint_path = checkpoint_path
        self.metrics, self.on_round, self.on_minibatch = metrics, on_round, on_minibatch
        self.task = create_task(config.task, seed=config.seed, **config.task_options)
        if model is None:
            with _INIT_LOCK:
                torch.manual_seed(config.seed)
                model = self.task.build_model()
        self.model = model
        self.per_minibatch = config.batch_size // config.minibatches
        self.data_epoch: int | None = None  # an elastic run's: the view the shard follows
        if peer.view is None:
            self.batches = self._shard(peer.topology.size, peer.rank,
                                       config.seed * 1000 + peer.rank)
        else:  # a joiner's comes with the view admitting it
            self.batches = None
            self.reshard()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=config.lr,
                                         momentum=config.momentum)
        if config.layer_delay:
            # read self.clock at each sleep: a subclass's own clock (a shared device's,
            # whose sleeps hold the device) is set after this constructor
            emulate_device(model, config.layer_delay, lambda seconds: self.clock.sleep(seconds))
        if config.overlap:
            peer.attach(model, bucket_mb=config.bucket_mb)
        self.delays = config.delays.for_rank(peer.rank, seed=config.seed)
        # the honest peers' consensus: attackers' models are not what training converges to
        self.consensus = ConsensusProbe(peer, self.task,
                                        left_out=frozenset(config.attack.by_rank))
        self.drawn = 0  # mini-batches computed so far: indexes this rank's straggler draws
        self.first_round = 0
        self.resumed_from: int | None = None  # the checkpoint's round, after a resume
        self.bytes_counted = (0, 0)  # sent and received before this process started
        self.started = self.clock.monotonic()

    # -- the run ---------------------------------------------------------------------------

    def resume(self, history: list[Mapping[str, Any]] | None = None, *,
               round: int | None = None) -> None:
        """Start from the checkpoint instead and rejoin the running peers (``Peer.rejoin``)
        at the round they agree on. With ``history`` (the records the killed process wrote)
        the lines of the rounds before that one are written again first (``lines_before``),
        and the byte counts go on from the last of them (else from the checkpoint's).
        ``round``: the generation of that round (checkpoint.generations), not the newest."""
        if self.checkpoint_path is None:
            raise CheckpointError("resume needs a checkpoint file (--checkpoint-dir)")
        self.resumed_from, self.drawn, self.bytes_counted = self._restore(round)
        for _ in range(self.drawn):  # the data stream is a pure function of (seed, draws)
            self.batches.next()
        self.first_round = self.peer.rejoin(self.resumed_from)
        log.warning("rank %d: resumed from the checkpoint of round %d, rejoined at round %d",
                    self.peer.rank, self.resumed_from, self.first_round)
        earlier = [] if history is None else lines_before(
            self.first_round, history, bytes_counted=self.bytes_counted,
            lost_peers=self.peer.lost_peers, wall=self.clock.time())
        last = earlier[-1] if earlier else {}
        if "bytes_sent" in last and "bytes_recv" in last:  # what the killed process counted
            self.bytes_counted = (last["bytes_sent"], last["bytes_recv"])
        if self.metrics is not None:
            for line in earlier:
                self.metrics.write(line)

    def enter(self) -> None:
        """On a spare rank of an elastic run: join the running members (``Peer.enter``),
        starting from its donor's model, optimizer and strategy state (``handover_state``)
        at the round it joins at (no round at all if the run ended first)."""
        entered = self.peer.enter()
        if entered is None:
            log.warning("rank %d: the run ended (or this peer was asked to leave) before "
                        "it was admitted", self.peer.rank)
            self.first_round = self.config.rounds  # no round left
            return
        self.first_round, data = entered
        state = state_from_bytes(data)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.peer.strategy.take_handover(state.get("strategy", {}))
        log.warning("rank %d: joined at round %d from peer %d's state %s", self.peer.rank,
                    self.first_round, self.peer.view.joins[self.peer.rank],
                    state_hash(self.model, self.optimizer))

    def snapshot(self) -> bytes:
        """The state a joiner starts from: model, optimizer and what the strategy hands
        over (``enter``; CHOCO's public copy, never a residual)."""
        return state_to_bytes({"model": self.model.state_dict(),
                               "optimizer": self.optimizer.state_dict(),
                               "strategy": self.peer.strategy.handover_state()})

    def run(self) -> Record | None:
        """Train the remaining rounds; returns the last one's record (None if none was left)."""
        self.started = self.clock.monotonic()  # a rejoin's wait is not training time
        record = None
        for round in range(self.first_round, self.config.rounds):
            record = self.train_round(round)
            line = record.as_dict()
            if self.metrics is not None:
                self.metrics.write(line)
            if self.on_round is not None:
                self.on_round(line)
            self.peer.hand_over(round, self.snapshot)  # a joiner's state, if this peer donates
            if (self.checkpoint_path is not None and self.config.checkpoint_every
                    and (round + 1) % self.config.checkpoint_every == 0):
                self.checkpoint(record)
            if self.peer.leave_requested and round < self.config.rounds - 1:
                log.warning("rank %d: leaving after round %d, as asked", self.peer.rank, round)
                self.peer.leave()
                break
        return record

    def train_round(self, round: int) -> Record:
        """Compute, synchronize, record, and probe when it is time to."""
        self.reshard()
        before, start = self.peer.stats, self.clock.monotonic()
        work = self.compute(round)
        comm_s = self.synchronize(round, work)
        iter_s = self.clock.monotonic() - start
        record = self.record(round, work, comm_s, before=before, after=self.peer.stats)
        overlap = self.peer.overlap_metrics()
        if overlap is not None:
            record = dataclasses.replace(record, iter_s=iter_s, **overlap)
        record = dataclasses.replace(record, **self.peer.strategy.record_fields(round))
        if self.config.elastic:  # the survivors' states stay bitwise equal: check it
            record = dataclasses.replace(record, epoch=self.peer.view.epoch,
                                         state_hash=state_hash(self.model, self.optimizer))
        if round % self.config.eval_every == 0 or round == self.config.rounds - 1:
            consensus, avg_accuracy = self.probe(round)
            record = dataclasses.replace(record, consensus=consensus, avg_accuracy=avg_accuracy)
        return record

    # -- the phases ------------------------------------------------------------------------

    def compute(self, round: int) -> Work:
        """Up to ``config.minibatches`` mini-batches, their gradients summed in ``.grad``,
        each followed by the delay ``config.delays`` injects for this rank; fewer when the
        strategy asks to stop (blocking strategies never do; ``nonblocking`` does once some
        peer has finished all of them)."""
        clock, model = self.clock, self.model
        start = clock.monotonic()
        model.train()
        self.optimizer.zero_grad(set_to_none=False)
        done, loss_sum, slept = 0, 0.0, 0.0
        for i in range(self.config.minibatches):
            # Checked only between mini-batches: a backward pass cannot be interrupted.
            if self.peer.stop_requested(round):
                break
            x, y = self.batches.next()
            c0 = clock.monotonic()
            # With overlap, only the last mini-batch's backward synchronizes.
            with self.peer.no_sync() if i < self.config.minibatches - 1 else nullcontext():
                loss = self.task.loss_fn(model(x), y)
                loss.backward()
            slept += self._inject_delay(clock.monotonic() - c0)
            done += 1
            loss_sum += loss.item()
            if self.on_minibatch is not None:
                self.on_minibatch(round, done)
        if done == self.config.minibatches:
            self.peer.computed_all(round)
        return Work(done, loss_sum, slept, clock.monotonic() - start)

    def synchronize(self, round: int, work: Work) -> float:
        """The synchronized step of round ``round`` (``Peer.step``); returns its seconds."""
        start = self.clock.monotonic()
        self.peer.step(self.model, self.optimizer, minibatches=work.minibatches)
        return self.clock.monotonic() - start

    def record(self, round: int, work: Work, comm_s: float, *, before: Mapping[str, Any],
               after: Mapping[str, Any]) -> Record:
        """The round's record, with this peer's test accuracy (and the task's other
        metrics); ``before`` and ``after`` are ``Peer.stats`` at the start of the round and
        after its step."""
        sent, received = (new + old for new, old in zip(algorithm_bytes(after),
                                                        self.bytes_counted))
        scores = dict.fromkeys(self.task.metrics)  # None: not scored this round
        if round % self.config.test_every == 0 or round == self.config.rounds - 1:
            scores = self.task.scores(*evaluate(self.model, self.task.test, self.task.loss_fn))
        done = work.minibatches
        return Record(
            round=round, time=self.clock.monotonic() - self.started, wall=self.clock.time(),
            loss=work.loss_sum / done if done else math.nan, **scores,
            bytes_sent=sent, bytes_recv=received, compute_s=work.seconds,
            delay_s=work.delay_s, comm_s=comm_s, wait_s=after["wait_s"] - before["wait_s"],
            minibatches=done, samples=done * self.per_minibatch,
            lost_peers=self.peer.lost_peers,
            resumed_from=self.resumed_from if round == self.first_round else None)

    def probe(self, round: int) -> tuple[float | None, float | None]:
        """The consensus distance and the average model's accuracy (None, None when a peer
        is lost: see ``ConsensusProbe``)."""
        return self.consensus.measure(self.model, round)

    def checkpoint(self, record: Record) -> None:
        """Write this peer's state after the round of ``record``: model, optimizer, strategy
        state, torch RNG, batches drawn, lost peers, the next round and the bytes so far."""
        checkpoints.save(self.checkpoint_path, {
            "rank": self.peer.rank, "strategy": self.config.strategy, "task": self.config.task,
            "round": record.round + 1, "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "strategy_state": self.peer.strategy_state(),
            "torch_rng": torch.get_rng_state(), "batches_drawn": self.drawn,
            "lost_peers": self.peer.lost_peers,
            "bytes": [record.bytes_sent, record.bytes_recv]})

    # -- helpers ---------------------------------------------------------------------------

    def _shard(self, shards: int, shard: int, seed: int):
        """Batches of shard ``shard`` of ``shards`` of the training split (the run's seeded
        partition), drawn in the order ``seed`` gives."""
        config = self.config
        split = partition(self.task.train.y, shards, scheme=config.partition,
                          alpha=config.alpha, seed=config.seed)
        batches = BatchStream(self.task.train, split[shard], batch_size=self.per_minibatch,
                              seed=seed)
        if self.peer.attack is not None:  # label flipping trains on its own data, changed
            batches = self.peer.attack.kind.data(batches, self.task.num_classes)
        return batches

    def reshard(self) -> None:
        """In an elastic run, the data shard follows (seed, epoch, slot), not the member id
        (spec: a joiner's id may exceed any partition's size): shard ``slot`` of the view's
        size, in an order of (seed, epoch, slot); epoch 0's is a static run's. It changes
        with the view installed when a round's computation starts."""
        peer, view = self.peer, self.peer.view
        if view is None or view.epoch == self.data_epoch or peer.rank not in view.members \
                or view.epoch == 0 and peer.rank >= peer.topology.size - peer.spares:
            return  # not elastic, no change, or a joiner that no view admitted yet
        slot, seed = view.slot(self.peer.rank), self.config.seed
        self.batches = self._shard(view.size, slot, (seed * 1_000_003 + view.epoch) * 1000
                                   + slot if view.epoch else seed * 1000 + slot)
        self.data_epoch = view.epoch

    def _inject_delay(self, measured: float) -> float:
        """Sleep the injected delay of the next mini-batch (sleeping costs no CPU, so many
        emulated slow peers can share few cores); returns the seconds asked for."""
        delay = self.delays.minibatch_delay(self.drawn, measured)
        self.clock.sleep(delay)
        self.drawn += 1
        return delay

    def _restore(self, round: int | None = None) -> tuple[int, int, tuple[int, int]]:
        """Load this peer's checkpoint (of ``round``, else the newest) into the model,
        optimizer, strategy, RNG and the peers it knew lost; returns (its round, batches
        drawn, bytes sent and received by then)."""
        path, peer, config = self.checkpoint_path, self.peer, self.config
        expect = {"rank": peer.rank, "strategy": config.strategy, "task": config.task}
        if round is not None:
            kept = checkpoints.generations(path, **expect)
            if round not in kept:
                raise CheckpointError(f"checkpoint {path}: no generation of round {round} "
                                      f"(kept: {sorted(kept) or 'none'})")
            path = kept[round]
        state = checkpoints.load(path, **expect)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            peer.load_strategy_state(state["strategy_state"])
            torch.set_rng_state(state["torch_rng"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise CheckpointError(f"checkpoint {path} does not fit this run: "
                                  f"{type(exc).__name__}: {first}") from None
        for rank, round in dict(state["lost_peers"]).items():
            peer.note_lost(int(rank), int(round), "lost before this peer's restart (checkpoint)")
        sent, received = state.get("bytes", (0, 0))  # absent from checkpoints of before
        return int(state["round"]), int(state["batches_drawn"]), (int(sent), int(received))


def train(peer: Peer, config: TrainConfig, *, metrics: MetricsWriter | None = None,
          on_round: Callable[[dict[str, Any]], None] | None = None,
          on_minibatch: Callable[[int, int], None] | None = None,
          model: torch.nn.Module | None = None, checkpoint_path: str | Path | None = None,
          resume: bool = False, history: list[dict[str, Any]] | None = None,
          make_trainer: Callable[..., Trainer] | None = None,
          resume_round: int | None = None) -> dict[str, Any]:
    """Train the configured task on an open ``peer``; returns the last round's record as a
    dict (empty if no round was left to train).

    Every peer builds the same model (same seed) and the same data split, then trains on
    its own shard. A round computes ``config.minibatches`` mini-batches of
    ``batch_size / minibatches`` samples, accumulating their gradients (blocking strategies:
    always all of them, i.e. one step on the whole batch; ``nonblocking``: until some peer
    has finished all of them), sleeping after each the delay ``config.delays`` injects for
    this rank, then takes one synchronized step, and writes one ``Record`` (its fields are
    the metrics file's schema; the consensus probe runs every ``eval_every`` rounds).

    With ``config.checkpoint_every`` and a ``checkpoint_path``, the peer's state is written
    there every that many rounds. With ``resume`` it starts from that file instead, rejoins
    the running peers (``Peer.rejoin``) and goes on from the round they agree on; its first
    record then holds ``resumed_from`` (the checkpoint's round).

    Args:
        metrics: Where each round's record goes.
        on_round: Called with each record (a dict).
        on_minibatch: Called as ``(round, finished)`` after each mini-batch (tests use it
            to keep peers in lockstep).
        model: Train this model in place instead of a fresh one (the caller must give every
            peer the same initial weights).
        checkpoint_path: This peer's checkpoint file.
        resume: Restart from ``checkpoint_path`` and rejoin.
        resume_round: With ``resume``: from the kept generation of this round (a whole job
            restarted together agrees on one: gossip.rendezvous.restart).
        history: With ``resume``: the records the peer wrote before it was restarted; those
            of rounds before the one it resumes at are written again first, and the byte
            counts go on from the last of them (else from the checkpoint's). A round before
            it that has no record (the process was killed after its messages of that round
            went out, before it recorded the round) gets a line with ``lost_work: true``.
        make_trainer: Builds the trainer instead of ``Trainer`` (same arguments), e.g.
            ``gossip.crossover.DeviceTrainer`` with its device.
    """
    trainer = (make_trainer or Trainer)(peer, config, model=model, checkpoint_path=checkpoint_path,
                      metrics=metrics, on_round=on_round, on_minibatch=on_minibatch)
    if resume:
        trainer.resume(history, round=resume_round)
    elif config.join:
        trainer.enter()
    last = runner(trainer).run()
    return {} if last is None else last.as_dict()


def runner(trainer: Trainer) -> Trainer | AsyncRunner:
    """What runs ``trainer``'s rounds: itself, or for an asynchronous strategy (no rounds)
    an ``AsyncRunner`` of the same phases without lockstep (budgets, polls, finish)."""
    return trainer if trainer.peer.strategy.synchronous else AsyncRunner(trainer)
