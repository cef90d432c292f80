"""Two jobs launched at once as `gossip peer` processes sharing their devices through the
arbiter process the launcher starts (config.yaml's device section)."""

from __future__ import annotations

import pytest

from gossip.config import TrainConfig
from gossip.crossover.grants import overlaps, read_grants, turn_breaks
from gossip.crossover.jobs import Job, launch_jobs
from gossip.metrics import read_jsonl
from gossip.netutil import free_ports
from gossip.topology import Topology


@pytest.mark.slow
def test_two_jobs_share_the_devices_in_turns(tmp_path):
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 3, "batch_size": 8,
                                    "eval_every": 100, "delays": {"compute": 0.02}})
    ports = free_ports(4)
    jobs = [Job(name, config, Topology.generate("ring", 2).relocated(ports=ports[2 * k:2 * k + 2]))
            for k, name in enumerate(["a", "b"])]
    launch_jobs(jobs, tmp_path, mode="crossover")
    grants = read_grants(tmp_path / "grants.jsonl")
    assert sorted({g["device"] for g in grants}) == ["dev0", "dev1"]
    assert len(grants) == 2 * 2 * 3
    assert overlaps(grants) == [] and turn_breaks(grants, ["a", "b"]) == 0
    for job in ("a", "b"):
        lines = read_jsonl(tmp_path / job / "peer-1.jsonl")
        assert [line["round"] for line in lines] == [0, 1, 2]
        assert all(line["device_hold_s"] >= 0.02 for line in lines)
