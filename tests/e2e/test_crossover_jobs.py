"""Two jobs launched at once as `gossip peer` processes sharing their devices through the
arbiter process the launcher starts (config.yaml's device section); the crossover
experiment, whose peers are forked (gossip.launching.forkserver), run from its file as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

from gossip.cluster import unavailable_reason
from gossip.config import TrainConfig
from gossip.crossover.grants import overlaps, read_grants, turn_breaks
from gossip.crossover.jobs import Job, arbiter_process, launch_jobs
from gossip.metrics import read_jsonl
from gossip.ports import free_ports
from gossip.topology import Topology

TRAIN = {"strategy": "dpsgd", "rounds": 3, "batch_size": 8, "eval_every": 100,
         "delays": {"compute": 0.02}}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Jobs a and b, each 2 peers, launched as new processes sharing devices in turns."""
    run_dir = tmp_path_factory.mktemp("launched")
    config, ports = TrainConfig.from_dict(TRAIN), free_ports(4)
    jobs = [Job(name, config, Topology.generate("ring", 2).relocated(ports=ports[2 * k:2 * k + 2]))
            for k, name in enumerate(["a", "b"])]
    launch_jobs(jobs, run_dir, mode="crossover")
    return run_dir


@pytest.mark.slow
def test_two_jobs_share_the_devices_in_turns(launched):
    grants = read_grants(launched / "grants.jsonl")
    assert sorted({g["device"] for g in grants}) == ["dev0", "dev1"]
    assert len(grants) == 2 * 2 * 3
    assert overlaps(grants) == [] and turn_breaks(grants, ["a", "b"]) == 0
    for job in ("a", "b"):
        lines = read_jsonl(launched / job / "peer-1.jsonl")
        assert [line["round"] for line in lines] == [0, 1, 2]
        assert all(line["device_hold_s"] >= 0.02 for line in lines)


@pytest.mark.slow
def test_the_experiment_forks_peers_that_train_as_launched_ones(launched, tmp_path):
    # In a virtual cluster where one can be made: forked peers enter their namespaces.
    netns = "{rate: 1gbit}" if unavailable_reason() is None else "null"
    spec = tmp_path / "tiny.yaml"
    spec.write_text(f"name: tiny\npeers: 2\nnetns: {netns}\nrepeats: 1\ndrop: 0\n"
                    f"train: {json.dumps(TRAIN)}\n"
                    "points: [{name: dpsgd, arms: [sequential, crossover]}]\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "gossip", "crossover", "run", str(spec),
                          "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    arms = json.loads((out / "summary.json").read_text())["dpsgd"]["arms"]
    assert arms["crossover"]["same_losses_as_alone"] and arms["crossover"]["repeats"] == 1
    forked = read_jsonl(out / "dpsgd" / "crossover" / "rep-0" / "a" / "peer-1.jsonl")
    assert [r["loss"] for r in forked] == [r["loss"] for r in
                                           read_jsonl(launched / "a" / "peer-1.jsonl")]
    assert overlaps(read_grants(out / "dpsgd" / "crossover" / "rep-0" / "grants.jsonl")) == []


@pytest.mark.slow
def test_two_ranks_of_a_launch_on_one_device_take_turns(tmp_path):
    # `gossip launch --peers 2 --device gpu0`: rank 1 waited its whole timeout ("held by
    # job solo rank 0"): the arbiter kept one request per job and device.
    with tempfile.TemporaryDirectory(prefix="gossip-arbiter-") as sockets:
        address = f"ipc://{sockets}/a.sock"
        with arbiter_process(address, patience_s=float("inf"),
                             grant_log=tmp_path / "grants.jsonl",
                             log_path=tmp_path / "arbiter.log"):
            run = subprocess.run([sys.executable, "-m", "gossip", "launch", "--peers", "2",
                                  "--rounds", "3", "--arbiter", address, "--device", "gpu0",
                                  "--job", "solo", "--timeout", "20",
                                  "--run-dir", str(tmp_path / "run")],
                                 capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    grants = sorted(read_grants(tmp_path / "grants.jsonl"), key=lambda g: g["t_grant"])
    assert sorted((g["rank"], g["round"]) for g in grants) == [(r, n) for r in range(2)
                                                               for n in range(3)]
    assert overlaps(grants) == []
