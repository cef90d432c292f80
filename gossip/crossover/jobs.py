"""Several jobs launched at once on the same machines: rank r of every job on device r
(and, in a virtual cluster, in namespace r, sharing its capped link), each job on ports of
its own, all of them sharing the devices through one arbiter.

```
RUN_DIR/grants.jsonl            one line per grant (every job, every device)
RUN_DIR/arbiter.log             the arbiter process's log, when one runs
RUN_DIR/JOB/peer-R.jsonl ...    each job's run directory, as `gossip launch` writes it
```
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gossip.config import TrainConfig
from gossip.crossover.connect import DeviceConfig
from gossip.errors import ConfigError, GossipError
from gossip.launching import processes as launch
from gossip.launching.forkserver import Zygote
from gossip.launching.plan import place_run
from gossip.matrix import check_run

#: How jobs share a device: an arbiter process with this patience, or lock files.
SHARING = {"crossover": math.inf, "fifo": 0.0, "flock": None, "slices": None}
START_S = 10.0  # for the arbiter's socket to appear


@dataclass(frozen=True)
class Job:
    """One job of a shared launch: its name (turns go by name), config and topology."""

    name: str
    config: TrainConfig
    topology: object  # a Topology; every job's has the same size


@contextlib.contextmanager
def arbiter_process(address: str, *, patience_s: float, grant_log: Path,
                    log_path: Path) -> Iterator[subprocess.Popen]:
    """`gossip arbiter` bound at ``address`` (``ipc://PATH``) until the block ends."""
    path = Path(address.removeprefix("ipc://"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gossip", "arbiter", "--bind", address,
                                 "--patience", str(patience_s), "--log", str(grant_log)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise GossipError(f"the arbiter did not start (see {log_path})")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=launch.STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def sharing(mode: str, run_dir: Path, *, slice_s: float = 0.01) -> Iterator[DeviceConfig]:
    """The device section every job's peers get (job name still to set), with the arbiter
    process running for ``crossover`` and ``fifo``."""
    if mode not in SHARING:
        raise ConfigError(f"sharing {mode!r}: expected one of {', '.join(SHARING)}")
    grants = run_dir.absolute() / "grants.jsonl"
    if SHARING[mode] is None:
        yield DeviceConfig(f"{mode}:{run_dir.absolute() / 'locks'}", slice_s=slice_s,
                           grant_log=str(grants))
        return
    # The socket in a short temporary directory: a Unix socket's path has at most 107
    # bytes, which a run directory's easily exceeds.
    with tempfile.TemporaryDirectory(prefix="gossip-arbiter-") as sockets:
        address = f"ipc://{sockets}/arbiter.sock"
        with arbiter_process(address, patience_s=SHARING[mode], grant_log=grants,
                             log_path=run_dir / "arbiter.log"):
            yield DeviceConfig(address)


def launch_jobs(jobs: Sequence[Job], run_dir: str | Path, *, mode: str = "crossover",
                rate: str | None = None, slice_s: float = 0.01,
                zygote: Zygote | None = None) -> float:
    """Run ``jobs`` at once sharing their devices by ``mode`` (a key of ``SHARING``), in a
    virtual cluster capped at ``rate`` if given; returns the seconds until the last peer
    ended. With ``zygote``, peers are forked from it instead of started as new processes
    (the same code, seconds sooner).

    Raises:
        LaunchFailed: a peer failed (every peer of every job was stopped).
    """
    from gossip.cluster import VirtualCluster

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*run_dir.glob("*/peer-*.jsonl"), run_dir / "grants.jsonl"):
        stale.unlink(missing_ok=True)  # a re-run must not mix with old records
    sizes = {job.topology.size for job in jobs}
    if len(sizes) != 1 or len({job.name for job in jobs}) != len(jobs):
        raise ConfigError("jobs sharing devices need distinct names and equal peer counts")
    for job in jobs:  # the matrix's cells, before any peer starts
        check_run(job.config, job.topology, arbiter=True)
    cluster = VirtualCluster(sizes.pop(), rate=rate) if rate is not None else None
    start = time.monotonic()
    with cluster or contextlib.nullcontext(), sharing(mode, run_dir, slice_s=slice_s) as device:
        procs = []
        for job in jobs:
            job_dir = run_dir / job.name
            placement = place_run(job.config, job.topology, job_dir, cluster,
                                  {"job": job.name,
                                   "device": replace(device, job=job.name).to_dict()})
            procs += launch.start_peers(
                placement.ranks, job_dir, ["--topology", str(job_dir / "topology.yaml"),
                                           "--config", str(job_dir / "config.yaml")],
                wrap=cluster.command if cluster else None,
                spawn=zygote.spawn(cluster.namespace if cluster else None) if zygote else None)
        launch.watch(procs, on_progress=lambda done: None)
    return time.monotonic() - start
