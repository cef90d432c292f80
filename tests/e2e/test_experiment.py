"""`gossip experiment run`, `gossip plot` and the delay flags, as a user runs them (what
starts no peer runs in-process: interpreter start-up costs seconds on two busy cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gossip.cli import main
from gossip.cli.flags import train_config
from gossip.metrics import read_jsonl

FIGURES = ("loss_vs_time.png", "loss_vs_bytes.png", "accuracy_vs_round.png",
           "accuracy_vs_bytes.png")
TINY = {
    "name": "tiny",
    "peers": 3,
    "graph": "ring",
    "target_loss": 2.0,
    "baseline": "dpsgd",
    "smooth": 2,
    "train": {"rounds": 8, "batch_size": 16, "minibatches": 2, "eval_every": 4,
              "delays": {"compute": 0.002, "slowdown": {1: 3.0}}},
    "runs": [{"name": "dpsgd", "strategy": "dpsgd"},
             {"name": "nb", "strategy": "nonblocking", "options": {"inner": "dpsgd"},
              "delays": {"straggler_prob": 0.2, "straggler_mean": 0.002}}],
}


def gossip(*args: str, cwd: Path, timeout: float = 180):
    return subprocess.run([sys.executable, "-m", "gossip", *args], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def cli(*args: str):
    """In-process (no interpreter start-up) for what starts no peer."""
    return CliRunner().invoke(main, list(args))


def one_error(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.slow  # peer processes
@pytest.mark.timeout(300)
def test_experiment_runs_every_run_then_plots_and_tabulates(tmp_path):
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(TINY))
    result = gossip("experiment", "run", "exp.yaml", "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    for name, delays in (("dpsgd", {"straggler_prob": 0.0}), ("nb", {"straggler_prob": 0.2})):
        config = yaml.safe_load((out / name / "config.yaml").read_text())
        assert config["train"]["delays"]["slowdown"] == {1: 3.0}  # base section, merged
        assert config["train"]["delays"]["straggler_prob"] == delays["straggler_prob"]
        for rank in range(3):
            records = read_jsonl(out / name / f"peer-{rank}.jsonl")
            assert [r["round"] for r in records] == list(range(8))
            assert {"minibatches", "samples", "delay_s", "wall"} <= set(records[-1])
    for figure in FIGURES:
        data = (out / figure).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, figure
    header = next(ln for ln in result.stdout.splitlines() if "strategy" in ln)
    assert "time to 2 s" in header and "speed-up vs dpsgd" in header
    assert "nonblocking(dpsgd)" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert [row["run"] for row in summary["runs"]] == ["dpsgd", "nb"]
    assert summary["runs"][0]["speed-up vs dpsgd"] == pytest.approx(1.0)

    # The plot step alone, with another target; an unknown baseline is one error line.
    again = cli("plot", str(out), "--target-loss", "1.5")
    assert again.exit_code == 0, again.output
    assert "time to 1.5 s" in again.stdout
    bad = cli("plot", str(out), "--baseline", "nope")
    assert bad.exit_code == 1 and "error: --baseline: no run 'nope'" in bad.stderr


@pytest.mark.parametrize("change, culprit", [
    ({"runs": [{"name": "a", "strategy": "nope"}]}, "runs[0] (a): unknown strategy 'nope'"),
    ({"runs": [{"name": "a", "bogus": 1}]}, "runs[0] (a): unknown field 'bogus'"),
    ({"runs": [{"name": "a"}, {"name": "a"}]}, "duplicate run 'a'"),
    ({"train": {"delays": {"slowdown": {7: 2.0}}}}, "run dpsgd: delays.slowdown: rank 7"),
    ({"baseline": "zz"}, "baseline: no run 'zz'"),
])
def test_bad_experiment_file_is_one_line_and_exit_1(tmp_path, change, culprit):
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({**TINY, **change}))
    result = cli("experiment", "run", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert culprit in one_error(result)
    assert not (tmp_path / "out").exists()  # nothing started


def test_delay_flags_make_the_delays_section():
    config = train_config(None, (), rounds=None, strategy="nonblocking", minibatches=2,
                           batch_size=8, slowdown=("1:3", "0:1.5"), compute_delay=0.002,
                           straggler_prob=0.5, straggler_mean=0.001, send_delay=("1:0.001",),
                           delay_seed=4)
    assert config.minibatches == 2
    assert config.delays.to_dict() == {
        "compute": 0.002, "slowdown": {1: 3.0, 0: 1.5}, "straggler_prob": 0.5,
        "straggler_mean": 0.001, "send_delay": {1: 0.001}, "seed": 4}
    assert train_config(None, (), send_delay=("0.01",)).delays.send_delay == 0.01


@pytest.mark.parametrize("args, culprit", [
    (["--slowdown", "x"], "--slowdown 'x': expected RANK:VALUE"),
    (["--slowdown", "5:2"], "delays.slowdown: rank 5 is not in the run"),
    (["--straggler-prob", "0.5"], "delays.straggler_mean: must be > 0"),
    (["--minibatches", "3"], "must be a multiple of minibatches (3)"),
])
def test_bad_delay_flags_are_one_line_and_exit_1(args, culprit):
    result = cli("launch", "--peers", "2", *args)
    assert result.exit_code == 1
    assert culprit in one_error(result)
