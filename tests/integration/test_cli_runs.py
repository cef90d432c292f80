"""Runs started from the command line in the simulator (the peers' real code, in process):
the training flags reach the peers, and the exit status tells the truth about deaths."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gossip.cli import main
from gossip.config import TrainConfig
from gossip.metrics import read_jsonl


def simulate(tmp_path, *args: str):
    return CliRunner().invoke(main, ["simulate", "--quiet", "--batch-size", "16",
                                     "--run-dir", str(tmp_path / "run"), *args])


def test_lr_0_is_pure_gossip(tmp_path):
    """No training step: the peers start from one model and mixing keeps it, so every
    record of every peer has the same test accuracy and the consensus stays 0."""
    assert TrainConfig(lr=0).lr == 0
    result = simulate(tmp_path, "--peers", "5", "--strategy", "dpsgd", "--rounds", "3",
                      "--lr", "0")
    assert result.exit_code == 0, result.output
    records = [r for rank in range(5) for r in read_jsonl(tmp_path / "run" / f"peer-{rank}.jsonl")]
    assert len(records) == 15 and len({r["accuracy"] for r in records}) == 1
    assert records[-1]["consensus"] == pytest.approx(0.0, abs=1e-12)
