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


def test_a_killed_asynchronous_peer_is_injected_and_counted_in_steps(tmp_path):
    """The simulator runs an asynchronous strategy as `gossip peer` does (AsyncRunner), a
    peer it kills itself does not fail the run, and the death is told in steps and samples;
    the survivors date the loss by their step, not round -1."""
    result = simulate(tmp_path, "--peers", "5", "--strategy", "adpsgd", "--rounds", "20",
                      "--compute-delay", "0.05", "--kill", "2:0.3", "--dead-after", "0.5")
    assert result.exit_code == 0, result.output
    assert "peer 2 died (killed by SIGKILL, injected) after 5 step(s), 80 samples" \
        in result.output
    lost = [r["lost_peers"] for rank in (1, 3)
            for r in read_jsonl(tmp_path / "run" / f"peer-{rank}.jsonl")]
    assert {"2"} <= {k for d in lost for k in d}  # noticed while training
    assert all(round >= 0 for d in lost for round in d.values()), lost


@pytest.mark.parametrize("tolerate, code", [(None, 1), ("1", 0)])
def test_a_peer_failing_fails_the_simulated_run(tmp_path, monkeypatch, tolerate, code):
    from gossip.training.synchronous import Trainer

    compute = Trainer.compute

    def failing(self, round):
        if self.peer.rank == 3 and round == 2:
            raise RuntimeError("injected by the test, not by the run")
        return compute(self, round)

    monkeypatch.setattr(Trainer, "compute", failing)
    result = simulate(tmp_path, "--peers", "5", "--strategy", "dpsgd", "--rounds", "6",
                      "--dead-after", "0.5", *(["--tolerate-deaths", tolerate] if tolerate else []))
    assert result.exit_code == code, result.output
    why = "peer 3 died (exit code 1) after 2 round(s): RuntimeError: injected by the test"
    assert why in result.output
    if code:
        assert result.output.rstrip().splitlines()[-1].startswith(f"error: 1 peer(s) died: {why}")
