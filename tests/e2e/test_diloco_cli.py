"""DiLoCo as a user runs it: `gossip launch --strategy local` with the outer optimizer's
options, real peer processes over ZeroMQ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossip.metrics import read_jsonl


@pytest.mark.slow
def test_a_launched_diloco_run_learns_and_ends_in_one_model(tmp_path: Path):
    options = ["period=4", "outer_lr=0.7", "outer_momentum=0.9", "nesterov=true"]
    result = subprocess.run(
        [sys.executable, "-m", "gossip", "launch", "--peers", "3", "--strategy", "local",
         *[arg for option in options for arg in ("--option", option)], "--rounds", "40",
         "--run-dir", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        losses = [line["loss"] for line in read_jsonl(tmp_path / "run" / f"peer-{rank}.jsonl")]
        assert len(losses) == 40
        assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    last = read_jsonl(tmp_path / "run" / "peer-0.jsonl")[-1]
    assert last["consensus"] == pytest.approx(0.0, abs=1e-10)  # round 39 averages
    assert last["accuracy"] > 0.8
