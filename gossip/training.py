"""The local training loop of one peer: mini-batches, synchronized steps, evaluation, metrics."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossip import checkpoint
from gossip.config import TrainConfig
from gossip.errors import CheckpointError, CollectiveAborted, PeerGone
from gossip.faults import DelayModel
from gossip.metrics import MetricsWriter
from gossip.peer import Peer
from gossip.strategies import EXACT_MEAN
from gossip.tasks import BatchStream, create_task, evaluate, partition

PROBE_TAG = "probe"  # ring all-reduce used only to measure consensus; its bytes are not counted
log = logging.getLogger("gossip.training")
# torch's global RNG is shared by the threads of a process (peers run as threads in tests):
# seeding and initializing must not interleave, or peers start from different models.
_INIT_LOCK = threading.Lock()


def train(peer: Peer, config: TrainConfig, *, metrics: MetricsWriter | None = None,
          on_round: Callable[[dict[str, Any]], None] | None = None,
          on_minibatch: Callable[[int, int], None] | None = None,
          model: torch.nn.Module | None = None, checkpoint_path: str | Path | None = None,
          resume: bool = False, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train the configured task on an open ``peer``; returns the last round's record.

    Every peer builds the same model (same seed) and the same data split, then trains on
    its own shard. A round computes ``config.minibatches`` mini-batches of
    ``batch_size / minibatches`` samples, accumulating their gradients (blocking strategies:
    always all of them, i.e. one step on the whole batch; ``nonblocking``: until some peer
    has finished all of them), sleeping after each the delay ``config.delays`` injects for
    this rank, then takes one synchronized step.

    Each round writes one metrics record: round, time (seconds since this peer started),
    wall (Unix time), loss (mean over the finished mini-batches; NaN, null in the file, if
    none), accuracy,
    bytes_sent, bytes_recv, compute_s (mini-batches, injected delays included), delay_s
    (injected), comm_s, wait_s, minibatches and samples finished, and every ``eval_every``
    rounds the consensus distance (mean squared distance of the peers' models to their
    average) and the test accuracy of that average model (null once a peer is lost: the probe
    is an all-reduce over every peer), and ``lost_peers`` ({rank: round noticed}, all so far).

    With ``config.checkpoint_every`` and a ``checkpoint_path``, the peer's state is written
    there every that many rounds (model, optimizer, strategy state, torch RNG, batches drawn,
    lost peers, next round). With ``resume`` it starts from that file instead, rejoins the
    running peers (``Peer.rejoin``) and goes on from the round they agree on; its first
    record then holds ``resumed_from`` (the checkpoint's round).

    Args:
        on_round: Called with each record.
        on_minibatch: Called as ``(round, finished)`` after each mini-batch (tests use it
            to keep peers in lockstep).
        model: Train this model in place instead of a fresh one (the caller must give every
            peer the same initial weights).
        checkpoint_path: This peer's checkpoint file.
        resume: Restart from ``checkpoint_path`` and rejoin.
        history: With ``resume``: the records the peer wrote before it was restarted; those
            of rounds before the one it resumes at are written again first, and the byte
            counts go on from the last of them (else from the checkpoint's). A round before
            it that has no record (the process was killed after its messages of that round
            went out, before it recorded the round) gets a line with ``lost_work: true``.
    """
    task = create_task(config.task, seed=config.seed)
    if model is None:
        with _INIT_LOCK:
            torch.manual_seed(config.seed)
            model = task.build_model()
    shards = partition(task.train.y, peer.topology.size, scheme=config.partition,
                       alpha=config.alpha, seed=config.seed)
    per_minibatch = config.batch_size // config.minibatches
    batches = BatchStream(task.train, shards[peer.rank], batch_size=per_minibatch,
                          seed=config.seed * 1000 + peer.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    delays = config.delays.for_rank(peer.rank, seed=config.seed)
    probe = peer.add_strategy(EXACT_MEAN, tag=PROBE_TAG)
    clock = peer.clock
    computed = 0  # mini-batches computed so far: indexes this rank's straggler draws
    first_round, resumed_from = 0, None
    counted = (0, 0)  # bytes sent and received before this process started (a resume)
    if resume:
        if checkpoint_path is None:
            raise CheckpointError("resume needs a checkpoint file (--checkpoint-dir)")
        resumed_from, computed, counted = _restore(checkpoint_path, peer, config, model,
                                                   optimizer)
        for _ in range(computed):  # the data stream is a pure function of (seed, draws)
            batches.next()
        first_round = peer.rejoin(resumed_from)
        log.warning("rank %d: resumed from the checkpoint of round %d, rejoined at round %d",
                    peer.rank, resumed_from, first_round)
        earlier = ([] if history is None else
                   _records_before(first_round, history, peer.lost_peers, counted,
                                   clock.time()))
        last = earlier[-1] if earlier else {}
        if "bytes_sent" in last and "bytes_recv" in last:  # what the killed process counted
            counted = (last["bytes_sent"], last["bytes_recv"])
        if metrics is not None:
            for old in earlier:
                metrics.write(old)
    start = clock.monotonic()
    record: dict[str, Any] = {}
    for rnd in range(first_round, config.rounds):
        before = peer.stats
        t0 = clock.monotonic()
        model.train()
        optimizer.zero_grad(set_to_none=False)
        done, loss_sum, slept = 0, 0.0, 0.0
        for _ in range(config.minibatches):
            # Checked only between mini-batches: a backward pass cannot be interrupted.
            if peer.stop_requested(rnd):
                break
            x, y = batches.next()
            c0 = clock.monotonic()
            loss = task.loss_fn(model(x), y)
            loss.backward()
            slept += _inject(clock, delays, computed, clock.monotonic() - c0)
            computed += 1
            done += 1
            loss_sum += loss.item()
            if on_minibatch is not None:
                on_minibatch(rnd, done)
        if done == config.minibatches:
            peer.computed_all(rnd)
        t1 = clock.monotonic()
        peer.step(model, optimizer, minibatches=done)  # .grad holds the sum of `done`
        t2 = clock.monotonic()
        after = peer.stats
        sent, received = (new + old for new, old in zip(_algorithm_bytes(after), counted))
        _, accuracy = evaluate(model, task.test, task.loss_fn)
        record = {
            "round": rnd,
            "time": clock.monotonic() - start,
            "wall": clock.time(),
            "loss": loss_sum / done if done else math.nan,
            "accuracy": accuracy,
            "bytes_sent": sent,
            "bytes_recv": received,
            "compute_s": t1 - t0,
            "delay_s": slept,
            "comm_s": t2 - t1,
            "wait_s": after["wait_s"] - before["wait_s"],
            "minibatches": done,
            "samples": done * per_minibatch,
            "consensus": None,
            "avg_accuracy": None,
            "lost_peers": peer.lost_peers,
        }
        if rnd == first_round and resumed_from is not None:
            record["resumed_from"] = resumed_from
        if rnd % config.eval_every == 0 or rnd == config.rounds - 1:
            record["consensus"], record["avg_accuracy"] = _probe(model, probe, rnd, task, peer)
        if metrics is not None:
            metrics.write(record)
        if on_round is not None:
            on_round(record)
        if (checkpoint_path is not None and config.checkpoint_every
                and (rnd + 1) % config.checkpoint_every == 0):
            checkpoint.save(checkpoint_path, {
                "rank": peer.rank, "strategy": config.strategy, "task": config.task,
                "round": rnd + 1, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "strategy_state": peer.strategy.state_dict(),
                "torch_rng": torch.get_rng_state(), "batches_drawn": computed,
                "lost_peers": peer.lost_peers, "bytes": [sent, received]})
    return record


def _records_before(first_round: int, history, lost_peers, counted: tuple[int, int],
                    wall_now: float) -> list[dict[str, Any]]:
    """One record per round before ``first_round``: the killed process's own, or a
    ``lost_work`` line where it had none. Such a round did happen for the neighbours (they
    mixed this peer's message of it) but its work died with the process: loss, accuracy and
    timings are unknown (null); time, wall and bytes stay those of the record before (bytes:
    ``counted``, the checkpoint's, if there is none)."""
    recorded = {old["round"]: old for old in history
                if isinstance(old.get("round"), int) and old["round"] < first_round}
    out: list[dict[str, Any]] = []
    for rnd in range(first_round):
        if rnd in recorded:
            out.append(recorded[rnd])
            continue
        before = out[-1] if out else {}
        out.append({"round": rnd, "time": before.get("time", 0.0),
                    "wall": before.get("wall", wall_now),
                    "loss": None, "accuracy": None,
                    "bytes_sent": before.get("bytes_sent", counted[0]),
                    "bytes_recv": before.get("bytes_recv", counted[1]), "compute_s": None,
                    "delay_s": None, "comm_s": None, "wait_s": None, "minibatches": 0,
                    "samples": 0, "consensus": None, "avg_accuracy": None,
                    "lost_peers": lost_peers, "lost_work": True})
    return out


def _restore(path, peer: Peer, config: TrainConfig, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[int, int, tuple[int, int]]:
    """Load this peer's checkpoint into the model, optimizer, strategy, RNG and the peers
    it knew lost; returns (its round, batches drawn, bytes sent and received by then)."""
    state = checkpoint.load(path, rank=peer.rank, strategy=config.strategy, task=config.task)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        peer.strategy.load_state_dict(state["strategy_state"])
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise CheckpointError(f"checkpoint {path} does not fit this run: "
                              f"{type(exc).__name__}: {first}") from None
    for rank, round in dict(state["lost_peers"]).items():
        peer.note_lost(int(rank), int(round), "lost before this peer's restart (checkpoint)")
    sent, received = state.get("bytes", (0, 0))  # absent from checkpoints of before
    return int(state["round"]), int(state["batches_drawn"]), (int(sent), int(received))


def _probe(model, probe, rnd: int, task, peer: Peer) -> tuple[float | None, float | None]:
    """The consensus probe, or (None, None) when it cannot run: it is an all-reduce over
    every peer, so a lost peer (or a rejoin under way) ends it, and training goes on."""
    if not peer.all_peers_can_meet(rnd):
        return None, None
    try:
        return _consensus(model, probe, rnd, task, peer)
    except (PeerGone, CollectiveAborted) as exc:
        log.info("rank %d: no consensus probe in round %d: %s", peer.rank, rnd, exc)
        return None, None


def _algorithm_bytes(stats: dict[str, Any]) -> tuple[int, int]:
    """Bytes sent and received so far, without the consensus probe's: it measures the run,
    it is not part of the algorithm. Counted per kind by the transport, so a probe message
    that arrives before this peer's own probe (from a faster peer) is still left out."""
    probe = [counts for kind, counts in stats["by_kind"].items()
             if kind.startswith(f"{PROBE_TAG}.")]
    return (stats["bytes_sent"] - sum(c["bytes_sent"] for c in probe),
            stats["bytes_recv"] - sum(c["bytes_recv"] for c in probe))


def _inject(clock, delays: DelayModel, index: int, measured: float) -> float:
    """Sleep the injected delay of mini-batch ``index`` (sleeping costs no CPU, so many
    emulated slow peers can share few cores); returns the seconds asked for."""
    delay = delays.minibatch_delay(index, measured)
    clock.sleep(delay)
    return delay


@torch.no_grad()
def _consensus(model, probe, rnd: int, task, peer: Peer) -> tuple[float, float]:
    """Mean squared distance of the peers' parameters to their average, and the average
    model's test accuracy, from one all-reduce of [params, ||params||^2] in float64."""
    params = [p for p in model.parameters()]
    x = parameters_to_vector(params).double()
    with peer.communicating():
        mean = probe.synchronize(torch.cat([x, x.dot(x).reshape(1)]), rnd)
    avg, mean_sq = mean[:-1], mean[-1].item()
    distance = max(mean_sq - avg.dot(avg).item(), 0.0)
    own = parameters_to_vector(params).clone()
    vector_to_parameters(avg.to(own.dtype), params)
    _, avg_accuracy = evaluate(model, task.test, task.loss_fn)
    vector_to_parameters(own, params)
    return distance, avg_accuracy
