"""PowerSGD as a user runs it: `gossip launch --strategy powersgd`, real processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gossip.metrics import read_jsonl


@pytest.mark.slow  # real processes: about 35 s on 2 cores
def test_launch_trains_with_powersgd_and_the_loss_falls(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gossip", "launch", "--peers", "3", "--strategy", "powersgd",
         "--option", "matrix_rank=2", "--option", "start_iter=2", "--rounds", "12",
         "--run-dir", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    records = [read_jsonl(tmp_path / "run" / f"peer-{rank}.jsonl") for rank in range(3)]
    for lines in records:
        assert [line["round"] for line in lines] == list(range(12))
        assert lines[-1]["loss"] < 0.5 * lines[0]["loss"]
        assert lines[-1]["consensus"] == 0.0  # every peer applied the same update
    assert len({lines[-1]["accuracy"] for lines in records}) == 1
