"""What a test leaves behind: Python threads, ZeroMQ contexts and child processes.

``Leaks.start()`` before a test notes what exists; ``Leaks.check()`` after it (once every
fixture of the test was torn down) waits a short grace for what is still winding down, then
names whatever the test started and left running. Left alone, a leaked peer thread or
context keeps its port and its CPU share and makes a later test fail for no reason of its
own; a leaked child process outlives the run.

Process-wide helpers that their library starts once and keeps are not leaks: pyzmq's
garbage-collector thread and its context (zero-copy sends), and multiprocessing's resource
tracker and forkserver processes.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import zmq

GRACE_S = 2.0  # for threads and children that are on their way out

# Every zmq.Context created since install() that still exists -> its serial number.
_contexts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_serials = itertools.count()
_last_serial = -1
_installed = False


def install() -> None:
    """Record every ZeroMQ context created from now on (once per process; cheap: a weak
    dictionary, nothing scanned). pyzmq's Context subclasses call this ``__init__`` too."""
    global _installed
    if _installed:
        return
    original = zmq.Context.__init__

    def recording_init(self, *args, **kwargs):
        global _last_serial
        original(self, *args, **kwargs)
        _contexts[self] = _last_serial = next(_serials)

    zmq.Context.__init__ = recording_init
    _installed = True


def _process_helpers() -> tuple[set[threading.Thread], set[int], set[int]]:
    """Threads, context ids and pids that a library keeps for the whole process."""
    from zmq.utils import garbage

    # Private to pyzmq (zmq/utils/garbage.py): read defensively.
    gc_context = getattr(garbage.gc, "_context", None)
    threads = {getattr(garbage.gc, "thread", None)} - {None}
    try:  # tqdm's monitor: started by the first progress bar, kept until the process exits
        from tqdm import tqdm

        threads |= {getattr(tqdm, "monitor", None)} - {None}
    except ImportError:
        pass
    contexts = {id(gc_context)} if gc_context is not None else set()
    pids = set()
    try:
        from multiprocessing import forkserver, resource_tracker

        pids |= {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    except (ImportError, AttributeError):  # another Python: nothing we know to spare
        pass
    return threads, contexts, pids - {None}


def children() -> dict[int, tuple[str, str]]:
    """This process's child processes: pid -> (state letter, command line)."""
    found = {}
    for pid in _child_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # reaped meanwhile
            continue
        state = stat.rsplit(")", 1)[1].split()[0]
        found[pid] = (state, cmdline.replace(b"\0", b" ").decode(errors="replace").strip())
    return found


def _child_pids() -> set[int]:
    """Children of every thread of this process (a thread's fork is that thread's child)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():  # no procfs (macOS): no check
        return set()
    pids = set()
    for task in tasks.iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except FileNotFoundError:  # a thread that just ended, or no CONFIG_PROC_CHILDREN
            continue
    return pids


def _reap(pids) -> None:
    """Collect the exit status of ``pids`` that have exited (zombies); leave the others."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # already reaped (by its Popen, or by a SIGCHLD handler)
            pass


@dataclass
class Leaks:
    """What existed when a test started: threads, children, the next context's serial."""

    threads: set[threading.Thread] = field(default_factory=set)
    child_pids: set[int] = field(default_factory=set)
    first_context: int = 0

    @classmethod
    def start(cls) -> Leaks:
        return cls(set(threading.enumerate()), _child_pids(), _last_serial + 1)

    def check(self, grace: float = GRACE_S) -> str | None:
        """None, or what was started since ``start()`` and is left behind (now cleaned up
        where that is harmless: open contexts destroyed, running children killed)."""
        deadline = time.monotonic() + grace
        helper_threads, helper_contexts, helper_pids = _process_helpers()
        problems = []

        threads = [t for t in threading.enumerate()
                   if t not in self.threads and t not in helper_threads
                   and t is not threading.current_thread()
                   # A native thread that called into Python: not ours to join.
                   and not isinstance(t, threading._DummyThread)]
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        alive = [t for t in threads if t.is_alive()]
        if alive:
            problems.append(f"{len(alive)} thread(s) still running: "
                            + ", ".join(sorted(t.name for t in alive)))

        contexts = [ctx for ctx, serial in list(_contexts.items())
                    if serial >= self.first_context and not ctx.closed
                    and id(ctx) not in helper_contexts and not getattr(ctx, "_shadow", False)]
        if contexts:
            problems.append(f"{len(contexts)} ZeroMQ context(s) not terminated: "
                            + ", ".join(repr(ctx) for ctx in contexts))
            if not alive:  # destroying sockets a live thread uses could crash it
                for ctx in contexts:
                    ctx.destroy(linger=0)

        running = self._new_children(helper_pids)
        while running and time.monotonic() < deadline:
            time.sleep(0.02)
            running = self._new_children(helper_pids)
        if running:
            problems.append(f"{len(running)} child process(es) still running: "
                            + "; ".join(f"pid {pid}: {cmd}" for pid, cmd in running.items()))
            for pid in running:
                try:  # a session leader's whole group: a launcher takes its peers along
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    os.waitpid(pid, 0)  # SIGKILL cannot be ignored: this returns at once
                except ChildProcessError:
                    pass
        return "; ".join(problems) or None

    def _new_children(self, spared: set[int]) -> dict[int, str]:
        """Children started during the test that still run; the exited ones are reaped."""
        new = {pid: info for pid, info in children().items()
               if pid not in self.child_pids and pid not in spared}
        _reap(pid for pid, (state, _) in new.items() if state == "Z")
        return {pid: cmd for pid, (state, cmd) in new.items() if state != "Z"}
