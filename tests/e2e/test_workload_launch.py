"""`gossip launch` of the language model: real peers, its loss and perplexity in the records
and the summary; what it cannot run is refused before any peer starts."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from gossip.metrics import read_jsonl


def gossip(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gossip", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # 20-40 s on a loaded 2-core machine, as the other launches
def test_launch_gpt_records_test_loss_and_perplexity(tmp_path):
    result = gossip("launch", "--peers", "2", "--task", "gpt", "--task-option", "ctx=32",
                    "--task-option", "test_windows=2", "--batch-size", "4", "--lr", "0.05",
                    "--rounds", "3", "--run-dir", "run", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        last = read_jsonl(tmp_path / "run" / f"peer-{rank}.jsonl")[-1]
        assert last["perplexity"] == math.exp(last["test_loss"]) and 0 <= last["accuracy"] <= 1
    assert "perplexity" in result.stdout and "mean test loss" in result.stdout


def test_launch_refuses_a_label_partition_of_a_language_model(tmp_path):
    result = gossip("launch", "--task", "gpt", "--partition", "dirichlet", cwd=tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "splits by class label, and task gpt's examples" in errors[0]
