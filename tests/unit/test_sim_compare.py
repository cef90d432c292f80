"""`gossip sim-compare`: its exit status says whether numerics and bytes were equal in every
round, and runs of different settings are refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from gossip.cli import main
from gossip.config import TrainConfig
from gossip.sim import NetworkModel, Simulation, simulate_run
from gossip.topology import Topology


def simulated(run_dir, *, seed=4, graph="ring", **options):
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 2, "batch_size": 8,
                                    "eval_every": 1, "seed": seed, "options": options})
    simulate_run(config, Topology.generate(graph, 5), run_dir,
                 Simulation(network=NetworkModel(rate="100mbit")))
    return str(run_dir)


def compare(real, sim):
    return CliRunner().invoke(main, ["sim-compare", real, sim])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return simulated(tmp_path_factory.mktemp("runs") / "a")


def test_the_same_run_twice_is_identical_and_exits_0(run, tmp_path):
    result = compare(run, simulated(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "numerics bitwise equal in 10, bytes sent equal in 10" in result.output
    assert result.output.rstrip().endswith("identical numerics and bytes")


def test_runs_that_differ_in_every_round_exit_1(run, tmp_path):
    other = tmp_path / "b"
    shutil.copytree(run, other)
    for path in other.glob("peer-*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**line, "loss": line["loss"] + 1}) + "\n"
                                for line in lines))
    result = compare(run, str(other))
    assert result.exit_code == 1
    assert "numerics bitwise equal in 0, bytes sent equal in 10" in result.output
    assert "first difference: peer-0.jsonl round 0: loss" in result.output
    assert result.output.rstrip().endswith("the runs differ")


@pytest.mark.parametrize("changed, named", [
    ({"seed": 5}, "seed 4 vs 5"),
    ({"staleness": 1}, "options {} vs {'staleness': 1}"),
    ({"graph": "complete"}, "the graph's edges")])
def test_runs_of_different_settings_are_refused_in_one_line(run, tmp_path, changed, named):
    result = compare(run, simulated(tmp_path / "b", **changed))
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert f"is not a run of {run}'s settings: " in result.output and named in result.output
