"""One parameter server's shard: the sync steps under way, or the async model and clocks.

It decides what to answer and when; ``reply(worker, meta, tensor)`` sends the answer (the
strategy owns the transport). Everything here runs on the transport's one thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gossip.strategies.ps.options import PSOptions
from gossip.strategies.ps.shards import participants

Reply = Callable[[int, dict, torch.Tensor], None]
# refuse(worker, step, stopped, last): ``step`` will never close, as worker ``stopped`` said
# goodbye after its round ``last`` (or died: None) without pushing it.
Refuse = Callable[[int, int, int, "int | None"], None]
INIT_STEP = -1  # async/ssp: the first push of every worker, averaged like a sync step


class ShardServer:
    """The shard this rank serves.

    Sync: the pushes of a step are summed in rank order once the first ``W - backup`` (or
    every participant's) have arrived, and the mean goes to every worker; later pushes of
    a closed step are dropped. With ``robust``, their robust aggregate goes instead (the
    server keeps the last one: centered-clip starts there). Async: a delta is added at once, scaled by ``scale`` (1/W by
    default), and the current shard is the answer. SSP: as async, but the answer to a push
    of clock c waits until every worker still training has pushed c - staleness times.
    A step that can no longer close because a worker it needs said goodbye without
    pushing it is refused to every worker still training (``refuse``), naming that worker.
    """

    def __init__(self, workers: tuple[int, ...], options: PSOptions, reply: Reply,
                 refuse: Refuse):
        self.workers, self.options, self.reply, self.refuse = workers, options, reply, refuse
        self.scale = options.scale if options.scale is not None else 1.0 / len(workers)
        self.steps: dict[int, dict[int, torch.Tensor]] = {}  # step -> pushes, arrival order
        # Steps close in order (a worker pushes step r + 1 only after step r's mean), so
        # a push of a step at or below the last closed one that is not open is late.
        self.closed_through = INIT_STEP - 1
        self.model: torch.Tensor | None = None  # async/ssp
        self.clocks = {w: 0 for w in workers}  # async/ssp: deltas applied per worker
        self.deferred: list[tuple[int, int]] = []  # ssp: (worker, clock) waiting to pull
        self.done: set[int] = set()
        self.last_rounds: dict[int, int | None] = {}  # worker -> its last round (goodbye)
        self.refused: set[int] = set()  # steps that can never close
        self.heard: set[int] = set()  # workers that pushed or said goodbye
        self.late_pushes = 0  # sync with backup: pushes of steps already closed
        self.robust = options.gathered()  # sync: a robust aggregate instead of the mean
        self.last_aggregate: torch.Tensor | None = None  # its state (centered-clip's start)
        self.flagged = 0  # robust: pushes left out as non-finite, in all

    def expected(self, step: int) -> tuple[int, ...]:
        if step == INIT_STEP:
            return self.workers
        o = self.options
        return participants(self.workers, o.participation, o.seed, step)

    def needed(self, step: int) -> int:
        backup = self.options.backup if step != INIT_STEP else 0
        return len(self.expected(step)) - backup

    # -- messages ---------------------------------------------------------------------------
    def push(self, worker: int, step: int, tensor: torch.Tensor) -> None:
        """A sync push (or an async worker's first, ``INIT_STEP``)."""
        self.heard.add(worker)
        if step in self.refused:  # the worker has the refusal already
            return
        if step <= self.closed_through and step not in self.steps:
            self.late_pushes += 1
            return
        pushes = self.steps.setdefault(step, {})
        pushes[worker] = tensor
        if len(pushes) >= self.needed(step):
            self._close(step)
        else:
            self.refuse_stuck()

    def delta(self, worker: int, clock: int, tensor: torch.Tensor) -> None:
        """An async/ssp worker's parameter delta, its ``clock``-th."""
        self.heard.add(worker)
        self.model.add_(tensor, alpha=self.scale)
        self.clocks[worker] = clock
        self.deferred.append((worker, clock))
        self._release()

    def goodbye(self, worker: int, last_round: int | None = None) -> None:
        """``worker`` trains no more: it said so after its round ``last_round``, or it died
        (None). It no longer holds back ssp pulls; a step it was needed in is refused."""
        self.done.add(worker)
        self.heard.add(worker)
        self.last_rounds.setdefault(worker, last_round)
        self._release()
        self.refuse_stuck()

    def stuck(self, gone: set[int]) -> tuple[int, list[int]] | None:
        """The first open step that can never close with the workers ``gone`` (those that
        have not pushed it), and those workers; None if every step still can."""
        for step, pushes in sorted(self.steps.items()):
            missing = sorted(w for w in self.expected(step) if w in gone and w not in pushes)
            if len(self.expected(step)) - len(missing) < self.needed(step):
                return step, missing
        return None

    def waiting_on(self, lost: set[int]) -> str | None:
        """Why a sync step can never close with ``lost`` workers gone, or None."""
        found = self.stuck(lost)
        if found is None:
            return None
        step, missing = found
        return (f"step {step} needs {self.needed(step)} pushes and worker(s) "
                f"{', '.join(map(str, missing))} are dead")

    def refuse_stuck(self, lost: set[int] = frozenset()) -> None:
        """Refuse the steps that the workers who said goodbye (or ``lost``, dead) leave
        unable to close to every other worker, so that those waiting for them fail naming
        who stopped instead of timing out and blaming this server."""
        gone = self.done | lost
        while (found := self.stuck(gone)) is not None:
            step, missing = found
            del self.steps[step]
            self.refused.add(step)
            for worker in self.workers:
                if worker not in gone:
                    self.refuse(worker, step, missing[0], self.last_rounds.get(missing[0]))

    # -- internals -------------------------------------------------------------------------

    def _close(self, step: int) -> None:
        pushes = self.steps.pop(step)
        used = sorted(list(pushes)[:self.needed(step)])  # the first arrivals, summed by rank
        if self.robust is not None:
            total, flagged = self.robust.aggregate([pushes[w] for w in used],
                                                   self.last_aggregate)
            self.last_aggregate, self.flagged = total.clone(), self.flagged + flagged
        else:
            total = pushes[used[0]].clone()
            for worker in used[1:]:
                total.add_(pushes[worker])
            total.div_(len(used))
        self.closed_through = max(self.closed_through, step)
        if step == INIT_STEP:
            self.model = total
            total = total.clone()
        for worker in self.workers:
            self.reply(worker, {"step": step, "clock": 0, "min_clock": 0, "used": len(used)},
                       total)

    def _release(self) -> None:
        """Answer the pulls whose staleness bound holds (all of them unless ssp)."""
        if not self.deferred:
            return
        training = [self.clocks[w] for w in self.workers if w not in self.done]
        slowest = min(training) if training else math.inf
        bound = self.options.staleness if self.options.mode == "ssp" else math.inf
        waiting = []
        for worker, clock in self.deferred:
            if slowest >= clock - bound:
                low = clock if math.isinf(slowest) else int(slowest)
                self.reply(worker, {"step": clock, "clock": clock, "min_clock": low},
                           self.model.clone())
            else:
                waiting.append((worker, clock))
        self.deferred = waiting
