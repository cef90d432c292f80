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

from gossip.errors import ConfigError, LaunchFailed
from gossip.metrics import last_record, read_jsonl

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


@dataclass(frozen=True)
class Death:
    """A peer process that ended before finishing: killed by a signal or exited non-zero."""

    rank: int
    code: int  # negative: the signal that killed it
    rounds: int  # rounds it had completed (an asynchronous peer: steps)
    last_line: str  # its log's last line (its one-line error when it failed itself)
    injected: bool = False  # a fault the run injected itself (e.g. `gossip simulate --kill`)
    samples: int | None = None  # an asynchronous peer's training samples; None: in rounds

    def describe(self) -> str:
        if self.code < 0:
            try:
                how = f"killed by {signal.Signals(-self.code).name}"
            except ValueError:
                how = f"killed by signal {-self.code}"
        else:
            how = f"exit code {self.code}"
        if self.injected:
            how += ", injected"
        done = (f"{self.rounds} round(s)" if self.samples is None
                else f"{self.rounds} step(s), {self.samples} samples")
        why = f": {self.last_line}" if self.code > 0 and self.last_line else ""
        return f"peer {self.rank} died ({how}) after {done}{why}"


def progress(records: list[dict], *, asynchronous: bool) -> dict[str, int | None]:
    """A peer's ``rounds`` and ``samples`` for its ``Death``, from its records so far."""
    rounds = records[-1]["round"] + 1 if records else 0
    return {"rounds": rounds,
            "samples": sum(r["samples"] for r in records) if asynchronous else None}


def check_deaths(deaths: list[Death], *, tolerate: int = 0) -> None:
    """The exit status of every run (`gossip launch`, `gossip simulate`, an experiment's
    runs): it failed if a peer died that the run did not kill itself, beyond ``tolerate``
    such deaths (``--tolerate-deaths``).

    Raises:
        LaunchFailed: naming every such peer, how it died and its last line.
    """
    failed = [death for death in deaths if not death.injected]
    if len(failed) <= tolerate:
        return
    first = failed[0]
    budget = f", more than the {tolerate} tolerated" if tolerate else ""
    raise LaunchFailed(first.rank, first.code, first.last_line, message=(
        f"{len(failed)} peer(s) died{budget}: " + "; ".join(d.describe() for d in failed)))


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


#: Starts rank's peer: ``spawn(rank, gossip_args, log_path, env)`` -> a Popen-like process.
Spawn = Callable[[int, list[str], Path, dict[str, str]], subprocess.Popen]


def start_peers(ranks: list[int], run_dir: Path, extra_args: list[str], *,
                wrap: Callable[[int, list[str]], list[str]] | None = None,
                spawn: Spawn | None = None) -> list[PeerProcess]:
    """One `python -m gossip peer` per rank, output to run_dir/peer-R.log.

    ``wrap(rank, argv)`` may prefix each command, e.g. to run it in a network namespace;
    ``spawn`` starts the peers another way instead (``gossip.launching.forkserver``: forked).
    """
    spawn = spawn or popen(wrap)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1")
    procs = []
    for rank in ranks:
        log_path = run_dir / f"peer-{rank}.log"
        args = ["peer", "--rank", str(rank), "--run-dir", str(run_dir), "--quiet", *extra_args]
        procs.append(PeerProcess(rank, spawn(rank, args, log_path, env), log_path,
                                 run_dir / f"peer-{rank}.jsonl"))
    return procs


def popen(wrap: Callable[[int, list[str]], list[str]] | None = None) -> Spawn:
    """Each peer a new `python -m gossip` process, its command prefixed by ``wrap``."""
    def spawn(rank: int, args: list[str], log_path: Path, env: dict[str, str]):
        cmd = [sys.executable, "-m", "gossip", *args]
        with open(log_path, "wb") as log:
            return subprocess.Popen(wrap(rank, cmd) if wrap else cmd, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return spawn


def watch(procs: list[PeerProcess], on_progress: Callable[[int], None],
          on_death: Callable[[Death], None] | None = None, *,
          asynchronous: bool = False,
          tick: Callable[[list[PeerProcess]], None] | None = None,
          injected: Callable[[int], bool] = lambda rank: False) -> list[Death]:
    """Wait for every peer, reporting rounds done; returns the peers that died meanwhile.

    A peer failing before its first round stops everyone at once (LaunchFailed): the run
    cannot start. With ``on_death``, a peer dying mid-run is reported to it and the others are
    left to handle it: gossip strategies drop it and finish, all-reduce strategies stop with
    an error naming it within the dead-peer delay; each has its own timeouts, so none hangs.
    Without ``on_death`` any failure stops everyone (a run that must be complete).

    ``asynchronous``: the peers count steps, not rounds (a death reports its samples too).
    ``tick(procs)``: called at every poll; it may start more peers (appended to ``procs``)
    or signal some (a churn schedule); ``injected(rank)``: whether a death was its doing.

    Raises:
        LaunchFailed: a peer failed at start (or at all, without ``on_death``), or no peer
            finished (one line: who died first and why the others stopped).
    """
    deaths: list[Death] = []
    try:
        while True:
            if tick is not None:
                tick(procs)
            done = sum(rounds_done(p) for p in procs)
            on_progress(done)
            for p in procs:
                code = p.process.poll()
                if code in (None, 0) or any(d.rank == p.rank for d in deaths):
                    continue
                death = Death(p.rank, code, last_line=p.last_log_line(),
                              injected=injected(p.rank),
                              **progress(read_jsonl(p.metrics_path)
                                         if p.metrics_path.exists() else [],
                                         asynchronous=asynchronous))
                if on_death is None or (death.rounds == 0 and not deaths):
                    stop(procs)
                    raise LaunchFailed(p.rank, code, death.last_line or "no output")
                deaths.append(death)
                on_death(death)
            if all(p.process.poll() is not None for p in procs):
                on_progress(sum(rounds_done(p) for p in procs))
                if len(deaths) == len(procs):
                    first, rest = deaths[0], deaths[1:]
                    others = (f"; the {len(rest)} other(s) stopped: "
                              f"{rest[0].last_line or 'no output'}" if rest else "")
                    raise LaunchFailed(first.rank, first.code, first.last_line,
                                       message=f"{first.describe()}{others}")
                return deaths
            time.sleep(POLL_S)
    except BaseException:
        stop(procs)
        raise


def stop(procs: list[PeerProcess]) -> None:
    """SIGTERM every running peer's process group, SIGKILL what is left after a grace period."""
    for p in procs:
        send_signal(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            send_signal(p, signal.SIGKILL)
            p.process.wait()


def send_signal(p: PeerProcess, sig: int) -> None:
    """Send ``sig`` to ``p``'s process group, if it still runs."""
    if p.process.poll() is None:
        try:
            os.killpg(p.process.pid, sig)
        except ProcessLookupError:
            pass


def rounds_done(p: PeerProcess) -> int:
    """Rounds ``p`` recorded so far."""
    record = last_record(p.metrics_path)
    return record["round"] + 1 if record else 0
