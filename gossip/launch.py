"""Start every local rank of a topology as a `gossip peer` process and watch them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gossip.errors import ConfigError
from gossip.metrics import last_record

POLL_S = 0.2
STOP_GRACE_S = 3.0


@dataclass
class PeerProcess:
    rank: int
    process: subprocess.Popen
    log_path: Path
    metrics_path: Path

    def last_log_line(self) -> str:
        """The last non-empty line the peer wrote to its log (its one-line error on failure)."""
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines()
                     if ln.strip()]
        except FileNotFoundError:
            return ""
        return lines[-1] if lines else ""


class LaunchFailed(Exception):
    """A peer exited non-zero; the others were stopped."""

    def __init__(self, rank: int, code: int, reason: str):
        super().__init__(f"peer {rank} failed (exit code {code}): {reason}")
        self.rank, self.code, self.reason = rank, code, reason


def local_ranks(topology) -> list[int]:
    """Ranks whose host is this machine (loopback or one of its own addresses)."""
    mine = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        mine |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    ranks = [p.rank for p in topology.peers if p.host in mine or p.host.startswith("127.")]
    if not ranks:
        raise ConfigError("no peer of the topology runs on this machine (hosts: "
                          f"{', '.join(sorted({p.host for p in topology.peers}))})")
    return ranks


def start_peers(ranks: list[int], run_dir: Path, extra_args: list[str], *,
                wrap: Callable[[int, list[str]], list[str]] | None = None) -> list[PeerProcess]:
    """One `python -m gossip peer` per rank, output to run_dir/peer-R.log.

    ``wrap(rank, argv)`` may prefix each command, e.g. to run it in a network namespace.
    """
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1")
    for rank in ranks:
        log_path = run_dir / f"peer-{rank}.log"
        with open(log_path, "wb") as log:
            cmd = [sys.executable, "-m", "gossip", "peer", "--rank", str(rank),
                   "--run-dir", str(run_dir), "--quiet", *extra_args]
            if wrap is not None:
                cmd = wrap(rank, cmd)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        procs.append(PeerProcess(rank, proc, log_path, run_dir / f"peer-{rank}.jsonl"))
    return procs


def watch(procs: list[PeerProcess], on_progress: Callable[[int], None]) -> None:
    """Wait for every peer; report rounds done; stop all and raise LaunchFailed on a failure."""
    try:
        while True:
            done = sum(_rounds_done(p) for p in procs)
            on_progress(done)
            failed = [p for p in procs if p.process.poll() not in (None, 0)]
            if failed:
                first = min(failed, key=lambda p: p.rank)
                stop(procs)
                raise LaunchFailed(first.rank, first.process.returncode,
                                   first.last_log_line() or "no output")
            if all(p.process.poll() == 0 for p in procs):
                on_progress(sum(_rounds_done(p) for p in procs))
                return
            time.sleep(POLL_S)
    except BaseException:
        stop(procs)
        raise


def stop(procs: list[PeerProcess]) -> None:
    """SIGTERM every running peer's process group, SIGKILL what is left after a grace period."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.process.wait()


def _signal(p: PeerProcess, sig: int) -> None:
    if p.process.poll() is None:
        try:
            os.killpg(p.process.pid, sig)
        except ProcessLookupError:
            pass


def _rounds_done(p: PeerProcess) -> int:
    record = last_record(p.metrics_path)
    return record["round"] + 1 if record else 0
