"""Peer processes forked from a server that has already imported torch and gossip.

A fresh `python -m gossip peer` spends about 4 s of CPU importing torch and torch._dynamo
(the first optimizer step imports it) before its first round: 20 s of wall time for the 8
peers of two jobs on 2 cores, against 5-10 s of training in each of the crossover
experiment's 30-40 launches. Forked from a process that holds those modules, a peer starts
in milliseconds and runs the same code. The forking is the standard library's forkserver
(a single-threaded server started once, its modules preloaded, which has never run a torch
operation, so no thread pool is copied half-alive into a child); this module gives each
child what `gossip launch` gives a peer process: its own session, its log file, its
environment and thread count, its network namespace, and a Popen-like handle. What the
child runs is the entry point its owner gives (the command line's), so this module, below the
command line, imports none of it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gossip.errors import NetnsError

#: What a peer imports before its first round (a failed import is skipped by the server),
#: with the entry point's own module.
PRELOAD = ["torch", "torch._dynamo", "torch.optim", "numpy", "zmq", "msgpack", "yaml",
           "gossip.peer", "gossip.training.synchronous", "gossip.strategies", "gossip.tasks"]
CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2) into a network namespace
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` keeps its namespaces


class ForkedPeer:
    """The part of ``subprocess.Popen`` that ``gossip.launching.processes`` uses, over a forked
    child."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # negative: the signal that ended it, as Popen's

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"peer process {self.pid}", timeout)
        return self._process.exitcode


class Zygote:
    """Starts peers as children of one forkserver, started with the first peer and ended
    with this process: one per experiment, for all its launches.

    Args:
        entry: What a child runs with a peer's arguments, as `python -m gossip ARGS` would
            (the command line's ``gossip.cli.common.run_forked``): a module-level function, which
            the server imports by name.
    """

    def __init__(self, entry: Callable[[list[str]], object]):
        self._entry = entry
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([*PRELOAD, entry.__module__])

    def spawn(self, namespace: Callable[[int], str] | None = None):
        """A ``gossip.launching.processes.Spawn``: rank's peer forked, in network namespace
        ``namespace(rank)`` if given (a virtual cluster's), else in this process's."""
        def start(rank: int, args: Sequence[str], log_path: Path,
                  env: Mapping[str, str]) -> ForkedPeer:
            process = self._context.Process(
                target=_run, name=f"gossip-peer-{rank}",
                args=(self._entry, list(args), str(log_path), dict(env),
                      namespace(rank) if namespace else None))
            process.start()
            return ForkedPeer(process)
        return start


def _run(entry: Callable[[list[str]], object], args: list[str], log_path: str,
         env: dict[str, str], namespace: str | None) -> None:
    """In the forked child: become what `python -m gossip ARGS` started by launch would be."""
    os.setsid()  # own process group: launch.stop signals it whole
    if namespace is not None:
        _enter_namespace(namespace)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if sys.stdout is not None:
        sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED's job
    os.environ.update(env)
    import torch

    # libgomp read OMP_NUM_THREADS when the server imported torch, before env was set here
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    entry(args)  # exits through SystemExit: the exit code


def _enter_namespace(name: str) -> None:
    """What `ip netns exec NAME` does for sockets: setns(2) into the named namespace (no
    os.setns before Python 3.12). Threads started later (ZeroMQ's) inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetnsError(f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)
