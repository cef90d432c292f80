"""Fitting the network model's sender costs (`gossip sim-fit`), with a known truth: "real"
runs that are simulations at known costs, dressed as netns runs. The fit must find those
costs and predict the other runs' round times exactly (modelled compute: deterministic)."""

from __future__ import annotations

import pytest
import yaml

from gossip.config import TrainConfig
from gossip.faults import DelayConfig
from gossip.errors import ConfigError
from gossip.sim import NetworkModel, Simulation, simulate_run
from gossip.sim.fit import RealRun, fit_costs, predict
from gossip.topology import Topology

TRUTH = {"message_s": 0.003, "byte_s": 4e-9}


def _dressed_as_real(run_dir, strategy, rate, task="digits"):
    """A simulated run at the true costs whose config.yaml reads as a real netns run's."""
    config = TrainConfig(strategy=strategy, task=task, rounds=6, batch_size=16,
                         eval_every=1000, delays=DelayConfig(compute=0.01))
    topology = Topology.generate("ring", 3)
    simulate_run(config, topology, run_dir, Simulation(network=NetworkModel(rate=rate, **TRUTH)))
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    del data["simulate"]
    data["netns"] = {"rate": rate}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return RealRun.read(run_dir)


@pytest.mark.slow  # 6 + 2 small simulations: seconds
def test_the_fit_finds_the_true_costs_and_predicts_other_rates_exactly(tmp_path):
    fit_runs = [_dressed_as_real(tmp_path / "real" / name, strategy, "100mbit")
                for name, strategy in (("dpsgd", "dpsgd"), ("ring", "ring-allreduce"))]
    other = _dressed_as_real(tmp_path / "real" / "dpsgd-20mbit", "dpsgd", "20mbit")
    fit = fit_costs(fit_runs, tmp_path / "probes", base=NetworkModel(), compute="model")
    assert fit.message_s == pytest.approx(TRUTH["message_s"], rel=0.02)
    assert fit.byte_s == pytest.approx(TRUTH["byte_s"], rel=0.05)
    rows = predict([*fit_runs, other], fit, tmp_path / "predicted", base=NetworkModel(),
                   compute="model")
    assert [row["role"] for row in rows] == ["fit", "fit", "predicted"]
    assert all(row["bytes equal"] for row in rows)
    assert max(row["median error"] for row in rows) < 0.01


def test_runs_that_no_network_model_describes_are_refused(tmp_path):
    config = TrainConfig(strategy="dpsgd", rounds=2, batch_size=16)
    simulate_run(config, Topology.generate("ring", 3), tmp_path / "sim", Simulation())
    with pytest.raises(ConfigError, match="a simulated run"):
        RealRun.read(tmp_path / "sim")
    data = yaml.safe_load((tmp_path / "sim" / "config.yaml").read_text())
    del data["simulate"]
    (tmp_path / "sim" / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="no netns rate"):
        RealRun.read(tmp_path / "sim")
    with pytest.raises(ConfigError, match="no config.yaml"):
        RealRun.read(tmp_path)
