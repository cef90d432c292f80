"""Virtual time for many peers in one thread: one greenlet per peer and one event heap.

Each peer runs its unchanged code in a greenlet. When it would wait (sleep, a receive with
nothing queued) it parks: it switches back to the scheduler, which pops the next event off a
heap ordered by (virtual time, sequence number) and runs it; an event may switch into a
parked peer again. Nothing runs at the same time, and ties go in the order the events were
made, so a run with the same inputs takes the same path every time (modelled compute).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

import greenlet
import torch

from gossip.errors import GossipError


class Killed(BaseException):
    """Thrown into a peer's greenlet that a fault kills: its code stops where it is (like a
    SIGKILLed process, what it would still do on the way out sends nothing)."""


class Task:
    """One peer's greenlet and its state in the scheduler."""

    def __init__(self, name: str, run: Callable[[], Any], scheduler: Scheduler,
                 threads: int | None = None):
        self.name = name
        self.greenlet = greenlet.greenlet(self._main, parent=scheduler.main)
        self._run = run
        self._scheduler = scheduler
        self.ended_at: float | None = None  # virtual time its code returned or raised
        self.wait_id = 0  # bumped at every park: a wake-up for an older park is stale
        self.parked = False
        self.killed = False
        self.done = False
        self.cpu_mark = 0.0  # thread CPU time when it last started running (compute model)
        # torch's per-thread state, which greenlets of one thread would otherwise share: a
        # peer parked inside ``torch.no_grad()`` must not switch gradients off for the rest,
        # nor one parked inside ``Peer.communicating()`` set the others' threads.
        self.grad_enabled = True
        self.threads = threads or torch.get_num_threads()  # intra-op threads
        self.error: BaseException | None = None
        self.result: Any = None

    def _main(self, *_: Any) -> None:  # the first switch passes the wake-up value
        try:
            self.result = self._run()
        except Killed:
            pass
        except BaseException as exc:  # noqa: BLE001 - kept for the runner, as a dead process
            self.error = exc
        finally:
            self.done = True
            self.ended_at = self._scheduler.now


class Scheduler:
    """The event heap and the virtual clock all peers share."""

    def __init__(self):
        self.now = 0.0
        self.main = greenlet.getcurrent()
        self.tasks: list[Task] = []
        self.events = 0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self._current: Task | None = None

    # -- events -----------------------------------------------------------------------------
    def at(self, when: float, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``when`` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn, args))

    def spawn(self, name: str, run: Callable[[], Any], *, threads: int | None = None) -> Task:
        """A peer running ``run()``, started at the current virtual time, with torch's
        intra-op threads set to ``threads`` (default: as now)."""
        task = Task(name, run, self, threads)
        self.tasks.append(task)
        self.at(self.now, self._resume, task, task.wait_id)
        return task

    def run(self, *, until: float | None = None) -> None:
        """Process events until none is left (or virtual time would pass ``until``)."""
        if greenlet.getcurrent() is not self.main:
            raise GossipError("Scheduler.run: called from inside a simulated peer")
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                return
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.events += 1
            fn(*args)

    # -- what a peer's code calls ------------------------------------------------------------
    @property
    def current(self) -> Task | None:
        """The task running now (None in the scheduler itself)."""
        return self._current

    def park(self, until: float | None) -> Any:
        """Suspend the running task until ``wake`` (returns what it was woken with) or until
        virtual time ``until`` (returns None). A task with no ``until`` must be woken."""
        task = self._current
        if task is None:
            raise GossipError("park: not inside a simulated peer")
        if task.killed:
            raise Killed()
        task.wait_id += 1
        task.parked = True
        if until is not None:
            self.at(until, self._resume, task, task.wait_id)
        value = self.main.switch()
        if task.killed:
            raise Killed()
        return value

    def sleep(self, seconds: float) -> None:
        """The running task waits ``seconds`` of virtual time (others run meanwhile)."""
        self.park(self.now + max(seconds, 0.0))

    def wake(self, task: Task, value: Any = None) -> None:
        """Resume a parked task at the current virtual time, after the events already due
        then (its timeout, if any, becomes stale). Never switches at once: a task waking
        another must go on until it parks itself."""
        if task.parked:
            self.at(self.now, self._resume, task, task.wait_id, value)

    def kill(self, task: Task) -> None:
        """Stop a task for good where it is (a fault): it never runs a line further."""
        task.killed = True
        if not task.done and not task.parked and task is not self._current:
            # Not started yet: it never runs.
            task.done = True
        elif task.parked:
            self._switch(task, None)

    def _resume(self, task: Task, wait_id: int, value: Any = None) -> None:
        if task.done or task.wait_id != wait_id:
            return  # a stale timeout: the task was woken earlier for that park
        self._switch(task, value)

    def _switch(self, task: Task, value: Any) -> None:
        task.parked = False
        self._current = task
        task.cpu_mark = time.thread_time()
        own = torch.is_grad_enabled(), torch.get_num_threads()
        _set_torch_state(task.grad_enabled, task.threads)
        try:
            task.greenlet.switch(value)
        finally:
            task.grad_enabled, task.threads = torch.is_grad_enabled(), torch.get_num_threads()
            _set_torch_state(*own)
            self._current = None


def _set_torch_state(grad_enabled: bool, threads: int) -> None:
    torch.set_grad_enabled(grad_enabled)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
