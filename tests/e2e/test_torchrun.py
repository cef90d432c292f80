"""`gossip peer --rendezvous env://` under torchrun (``python -m torch.distributed.run``):
the same results as the static topology file's run, and a whole-job restart
(``--max-restarts 1``) after a peer is killed resumes at the newest checkpoint round every
peer kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossip.metrics import read_jsonl

# Whole launcher runs (torchrun starts 5 processes twice): `pytest -m launchers` runs only these.
pytestmark = [pytest.mark.slow, pytest.mark.launchers]

REPO = Path(__file__).resolve().parents[2]
PEERS, ROUNDS, EVERY, VICTIM = 4, 8, 2, 2
# A round of at least 0.2 s (slept), so the kill lands while the victim still has rounds to
# go, not after it finished (then the restart has nothing left to resume).
TRAIN = ["--rounds", str(ROUNDS), "--checkpoint-every", str(EVERY), "--timeout", "120",
         "--dead-after", "30", "--compute-delay", "0.2"]
# What the model computes; bytes are compared at the end (a round's count depends on when
# the next round's messages arrive).
MODEL_FIELDS = ("round", "loss", "accuracy", "consensus", "avg_accuracy")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _torchrun(run_dir: Path, *extra: str) -> subprocess.Popen:
    (run_dir.parent / "exponential.yaml").write_text("graph: {kind: exponential}\n")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(PEERS), *extra, "-m", "gossip", "peer", "--rendezvous", "env://", "--topology",
         str(run_dir.parent / "exponential.yaml"), "--run-dir", str(run_dir), "--quiet", *TRAIN],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 500) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout:g} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _records(run_dir: Path) -> list[list[dict]]:
    return [read_jsonl(run_dir / f"peer-{rank}.jsonl") for rank in range(PEERS)]


def _model(records: list[dict]) -> list[tuple]:
    return [tuple(r[f] for f in MODEL_FIELDS) for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The static run (`gossip launch`, the same graph and seed) and torchrun's."""
    root = tmp_path_factory.mktemp("torchrun")
    static = subprocess.run(
        [sys.executable, "-m", "gossip", "launch", "--graph", "exponential", "--peers",
         str(PEERS), "--run-dir", str(root / "static"), *TRAIN],
        env=_env(), capture_output=True, text=True, timeout=500)
    assert static.returncode == 0, static.stdout[-2000:] + static.stderr[-2000:]
    _finish(_torchrun(root / "torchrun"))
    return root / "static", root / "torchrun"


def test_torchrun_trains_bitwise_like_the_static_topology(runs):
    static, torchrun = map(_records, runs)
    for rank in range(PEERS):
        assert _model(torchrun[rank]) == _model(static[rank]), f"rank {rank}"
        assert [torchrun[rank][-1][f] for f in ("bytes_sent", "bytes_recv")] == \
            [static[rank][-1][f] for f in ("bytes_sent", "bytes_recv")]
    written = runs[1] / "topology.yaml"  # rank 0 wrote where everyone listened
    assert written.exists() and (runs[1] / "config.yaml").exists()


def _worker(parent: int, rank: int) -> int | None:
    """The pid of torchrun's first-incarnation worker of ``rank``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == parent and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


def test_a_killed_peer_restarts_the_job_at_the_common_checkpoint_round(runs, tmp_path):
    run_dir = tmp_path / "restarted"
    proc = _torchrun(run_dir, "--max-restarts", "1")
    victim_log, deadline, killed = run_dir / f"peer-{VICTIM}.jsonl", time.monotonic() + 500, None
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        if victim_log.exists() and len(victim_log.read_text().splitlines()) >= 2 * EVERY + 1:
            killed = _worker(proc.pid, VICTIM)
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    assert killed is not None, "the victim was never seen mid-run"
    _finish(proc)
    reference = _records(runs[1])
    resumed = set()
    for rank, records in enumerate(_records(run_dir)):
        assert [r["round"] for r in records] == list(range(ROUNDS)), f"rank {rank}"
        first = next(r for r in records if r.get("resumed_from") is not None)
        resumed.add((first["round"], first["resumed_from"]))
        after = [r for r in records if r["round"] >= first["round"]]
        assert _model(after) == _model(reference[rank][first["round"]:]), f"rank {rank}"
    (at, checkpoint), = resumed  # every peer at the same round, from the same checkpoint
    assert at == checkpoint and checkpoint % EVERY == 0 and EVERY <= checkpoint < ROUNDS
