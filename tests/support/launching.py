"""`gossip launch` with one peer SIGKILLed (or sent another signal) mid-run: tests of dead
peers and elastic runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from gossip.metrics import read_jsonl
from gossip.topology import Topology
from gossip.transport.endpoints import local_ipc
from support.waiting import wait_until


def pid_of_rank(launch_pid: int, rank: int) -> int | None:
    """The pid of `gossip peer --rank RANK` among the launcher's children."""
    try:
        children = Path(f"/proc/{launch_pid}/task/{launch_pid}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--rank" in argv and argv[argv.index(b"--rank") + 1] == str(rank).encode():
            return int(pid)
    return None


def launch_and_kill(run_dir: Path, *, peers: int, rounds: int, victim: int, after: int,
                     flags: tuple[str, ...] = (),
                    sig: int = signal.SIGKILL) -> tuple[subprocess.Popen, str, str, int]:
    """`gossip launch` whose rank ``victim`` gets ``sig`` once it recorded ``after`` rounds:
    the finished launcher, its output and error, and the rounds the victim had recorded."""
    launch = subprocess.Popen(
        [sys.executable, "-m", "gossip", "launch", "--peers", str(peers), "--rounds",
         str(rounds), "--run-dir", str(run_dir), "--timeout", "30", "--dead-after", "1",
         "--compute-delay", "0.02", *flags],
        cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        def victim_under_way() -> int | None:
            assert launch.poll() is None, launch.communicate()
            path = run_dir / f"peer-{victim}.jsonl"
            return path.exists() and len(read_jsonl(path)) >= after and pid_of_rank(
                launch.pid, victim)

        os.kill(wait_until(victim_under_way, 90, f"the victim to get {after} rounds in"),
                sig)
        killed_after = len(read_jsonl(run_dir / f"peer-{victim}.jsonl"))
        out, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        topology = run_dir / "topology.yaml"
        if topology.exists():  # a killed peer leaves its Unix socket file behind
            ipc = local_ipc(Topology.from_yaml(topology).address(victim))
            Path(ipc.removeprefix("ipc://")).unlink(missing_ok=True)
    return launch, out, err, killed_after
