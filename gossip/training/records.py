"""The metrics schema: one ``Record`` per round and peer, one line of ``peer-R.jsonl``."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


TASK_FIELDS = ("test_loss", "perplexity")
_DEVICE_FIELDS = ("device_wait_s", "device_hold_s", "round_start_wall")
OVERLAP_FIELDS = ("exposed_comm_s", "comm_busy_s", "iter_s", "buckets")
ROBUST_FIELDS = ("robust_share", "robust_flagged")
ELASTIC_FIELDS = ("epoch", "state_hash")


@dataclass(frozen=True)
class Record:
    """What one peer did in one round. The fields, in this order, are the keys of its JSONL
    line; ``resumed_from``, ``lost_work``, the task's extra metrics, the device, overlap,
    staleness and robust fields are written only when set.

    Attributes:
        round: The round.
        time: Seconds since this peer's process started training.
        wall: Unix time.
        loss: Mean training loss of the finished mini-batches; NaN (null in the file) if none.
        accuracy: Test accuracy of this peer's model.
        bytes_sent: Bytes this peer's algorithm sent so far (header + frames, every round;
            the consensus probe's left out).
        bytes_recv: Bytes it received so far, likewise.
        compute_s: Seconds computing mini-batches, injected delays included.
        delay_s: Seconds of injected delay among them.
        comm_s: Seconds of the synchronized step.
        wait_s: Seconds of it spent waiting for messages.
        minibatches: Mini-batches finished (fewer than configured when ``nonblocking``
            stopped this peer early).
        samples: Training samples of those mini-batches.
        consensus: Every ``eval_every`` rounds and in the last one: the mean squared
            distance of the peers' models to their average (the honest peers' in a run
            with attackers); None otherwise, and once a peer is lost (the probe is an
            all-reduce over every peer).
        avg_accuracy: Test accuracy of that average model, when ``consensus`` is measured.
        lost_peers: Every peer lost so far, ``{rank: round this peer noticed it in}``.
        resumed_from: On the first record after a restart: the checkpoint's round.
        lost_work: A round the killed process did but never recorded: its neighbours mixed
            its messages, but its loss, accuracy and timings died with it (None).
        device_wait_s, device_hold_s, round_start_wall: Only with a shared device
            (``gossip.crossover``): seconds the compute phase waited for the device and held
            it, and the Unix time the round started.
        exposed_comm_s: With ``overlap``: seconds the step waited for the communication
            thread (the communication not hidden behind compute).
        comm_busy_s: With ``overlap``: seconds the communication thread was busy.
        iter_s: With ``overlap``: round start to after the optimizer step (no evaluation).
        buckets: With ``overlap``: synchronizations per round (gradient buckets; 1 for
            combine-then-adapt).
        staleness: With bounded staleness (dpsgd ``staleness`` > 0): how many rounds old
            the oldest neighbour model mixed in this round was.
        robust_share: With robust mixing (a gossip strategy's ``robust`` option): the share
            of the neighbours' models clipped in this round (of their values, trimmed).
        robust_flagged: With robust mixing: neighbours whose model had a non-finite value,
            left out of this round's mix.
        test_loss, perplexity: A task that reports them (``Task.metrics``; a language
            model): this peer's model's mean test loss (nats per target) and e^test_loss.
        epoch: In an elastic run: the view this round ended on (gossip/transport/epochs.py).
        state_hash: In an elastic run: blake2b of the parameters and the optimizer state
            after the round (``state_hash``); equal on every member in every round.
    """

    round: int
    time: float
    wall: float
    loss: float | None
    accuracy: float | None
    bytes_sent: int
    bytes_recv: int
    compute_s: float | None
    delay_s: float | None
    comm_s: float | None
    wait_s: float | None
    minibatches: int
    samples: int
    consensus: float | None = None
    avg_accuracy: float | None = None
    lost_peers: Mapping[int, int] = field(default_factory=dict)
    resumed_from: int | None = None
    lost_work: bool = False
    device_wait_s: float | None = None
    device_hold_s: float | None = None
    round_start_wall: float | None = None
    exposed_comm_s: float | None = None
    comm_busy_s: float | None = None
    iter_s: float | None = None
    buckets: int | None = None
    staleness: int | None = None
    robust_share: float | None = None
    robust_flagged: int | None = None
    test_loss: float | None = None
    perplexity: float | None = None
    epoch: int | None = None
    state_hash: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSONL line (``MetricsWriter.write`` turns NaN into null)."""
        line = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.resumed_from is None:
            del line["resumed_from"]
        if not self.lost_work:
            del line["lost_work"]
        for key in (*TASK_FIELDS, *_DEVICE_FIELDS, *OVERLAP_FIELDS, *ROBUST_FIELDS,
                    *ELASTIC_FIELDS, "staleness"):
            if line[key] is None:
                del line[key]
        return line

    @classmethod
    def from_dict(cls, line: Mapping[str, Any]) -> Record:
        """A record read back from its JSONL line (where ``lost_peers`` has string keys).

        Raises:
            TypeError: a key is not a field, or a field without default is missing.
        """
        lost = {int(rank): round for rank, round in (line.get("lost_peers") or {}).items()}
        return cls(**{**line, "lost_peers": lost})

    @classmethod
    def of_lost_work(cls, round: int, *, previous: Mapping[str, Any],
                     bytes_counted: tuple[int, int], lost_peers: Mapping[int, int],
                     wall: float) -> Record:
        """The line of a round whose work died with the killed process: loss, accuracy and
        timings unknown; time, wall and bytes those of the ``previous`` line (bytes: the
        checkpoint's ``bytes_counted``, wall: ``wall``, when there is none)."""
        return cls(round=round, time=previous.get("time", 0.0),
                   wall=previous.get("wall", wall), loss=None, accuracy=None,
                   bytes_sent=previous.get("bytes_sent", bytes_counted[0]),
                   bytes_recv=previous.get("bytes_recv", bytes_counted[1]),
                   compute_s=None, delay_s=None, comm_s=None, wait_s=None, minibatches=0,
                   samples=0, lost_peers=lost_peers, lost_work=True)


def lines_before(first_round: int, history: list[Mapping[str, Any]], *,
                 bytes_counted: tuple[int, int], lost_peers: Mapping[int, int],
                 wall: float) -> list[Mapping[str, Any]]:
    """The lines a restarted peer writes again for the rounds before ``first_round``, the
    one it rejoined at: the killed process's own (``history``, as read back), or a
    ``lost_work`` line where it had none. Such a round did happen for the neighbours (they
    mixed this peer's message of it), so the file keeps one line per round."""
    recorded = {old["round"]: old for old in history
                if isinstance(old.get("round"), int) and old["round"] < first_round}
    out: list[Mapping[str, Any]] = []
    for round in range(first_round):
        if round in recorded:
            out.append(recorded[round])
        else:
            out.append(Record.of_lost_work(round, previous=out[-1] if out else {},
                                           bytes_counted=bytes_counted, lost_peers=lost_peers,
                                           wall=wall).as_dict())
    return out


def state_hash(model, optimizer) -> str:
    """blake2b of ``model``'s state and ``optimizer``'s per-parameter state tensors, in their
    order: equal exactly when both are bitwise equal."""
    digest = hashlib.blake2b(digest_size=16)
    tensors = list(model.state_dict().values())
    for _, state in sorted(optimizer.state_dict()["state"].items()):
        tensors += [value for _, value in sorted(state.items()) if torch.is_tensor(value)]
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
