"""Experiment runs with ``simulate:``: parsed and checked with the file, run in virtual time
into the run directories `gossip plot` reads."""

from __future__ import annotations

import pytest

from gossip.errors import ConfigError
from gossip.experiment.report import report
from gossip.experiment.runner import run_experiment
from gossip.experiment.spec import parse_experiment
from gossip.sim import MeasuredCompute

BASE = {"name": "sim", "peers": 3, "train": {"rounds": 2, "batch_size": 8, "eval_every": 1}}


def test_simulate_true_or_a_mapping_and_the_netns_rate_as_default():
    experiment = parse_experiment({**BASE, "netns": {"rate": "100mbit"}, "runs": [
        {"name": "real", "strategy": "dpsgd", "simulate": False},
        {"name": "plain", "strategy": "dpsgd", "simulate": True},
        {"name": "tuned", "strategy": "dpsgd",
         "simulate": {"latency": 0.001, "sharing": "fair", "compute": "measured:2",
                      "kills": {1: 0.5}, "probe": "oracle"}}]})
    real, plain, tuned = experiment.runs
    assert real.simulation is None and real.rate == "100mbit"
    assert plain.simulation.network.rate == "100mbit"
    assert (tuned.simulation.network.latency, tuned.simulation.network.sharing) == (0.001, "fair")
    assert tuned.simulation.compute == MeasuredCompute(2.0)
    assert (dict(tuned.simulation.kills), tuned.simulation.probe) == ({1: 0.5}, "oracle")


@pytest.mark.parametrize("simulate, culprit", [
    ("yes", "simulate: expected true or a mapping"),
    ({"speed": 1}, "network: unknown field 'speed'"),
    ({"latency": -1}, "network latency"),
    ({"compute": "gpu"}, "--compute 'gpu'"),
    ({"kills": {"x": 1}}, "simulate: kills: expected {rank: seconds}"),
    ({"kills": [1, 2]}, "simulate: kills: expected {rank: seconds}"),
])
def test_a_bad_simulate_section_names_the_run(simulate, culprit):
    with pytest.raises(ConfigError) as info:
        parse_experiment({**BASE, "runs": [{"name": "x", "simulate": simulate}]})
    assert "runs[0] (x)" in str(info.value) and culprit in str(info.value)


@pytest.mark.slow
def test_a_simulated_experiment_writes_runs_that_plot(tmp_path):
    experiment = parse_experiment({**BASE, "simulate": {"rate": "10mbit"}, "runs": [
        {"name": "dpsgd", "strategy": "dpsgd"},
        {"name": "ring", "strategy": "ring-allreduce"}]})
    assert run_experiment(experiment, tmp_path, echo=lambda line: None, progress=False) == []
    for name in ("dpsgd", "ring"):
        assert sorted(p.name for p in (tmp_path / name).glob("peer-*.jsonl")) == [
            "peer-0.jsonl", "peer-1.jsonl", "peer-2.jsonl"]
        assert "simulate:" in (tmp_path / name / "config.yaml").read_text()
    rows = report(tmp_path, echo=lambda line: None)
    assert len(rows) == 2 and (tmp_path / "loss_vs_time.png").exists()
