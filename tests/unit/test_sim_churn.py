"""`gossip simulate --elastic --churn`: launch's schedule (the same parser and
membership.jsonl) done to simulated peers in virtual time; the elastic code unchanged."""

from __future__ import annotations

import json
import logging
import re

import pytest
from click.testing import CliRunner

from gossip.cli import main
from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.launching.churn import Event, Schedule, parse
from gossip.sim import Simulation, simulate_run
from gossip.sim.churn import SimChurn
from gossip.sim.sizes import simulate_sizes
from gossip.topology import Topology

ROUNDS = 24


def test_a_join_a_leave_and_a_kill_keep_every_members_state_equal(tmp_path, caplog):
    """P = 7 on ring-allreduce: rank 7 joins once round 4 is reached, 3 leaves after its
    10th round, 5 is killed after its 16th; every round's members hold one state hash, the
    joiner starts from its donor's, and membership.jsonl records the three events."""
    events = parse("join@4,leave:3@10,kill:5@16", 7)
    config = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": ROUNDS,
                                    "batch_size": 8, "seed": 3, "elastic": True,
                                    "spares": 1, "dead_after": 0.5,
                                    "delays": {"compute": 0.1}})
    with caplog.at_level(logging.WARNING, logger="gossip"):
        run = simulate_run(config, Topology.generate("ring", 8), tmp_path, Simulation(),
                           churn=events)
    assert run.failed == {} and run.killed == [5]
    records = {rank: {line["round"]: line for line in lines}
               for rank, lines in run.records.items()}
    for rank in (0, 1, 2, 4, 6, 7):
        assert max(records[rank]) == ROUNDS - 1
    assert sorted(records[3]) == list(range(10))  # left right after its 10th round
    assert 16 <= len(records[5]) <= 17  # killed once it parked after its 16th
    joined = min(records[7])
    assert 4 < joined < 10
    for round in range(ROUNDS):
        hashes = {lines[round]["state_hash"] for lines in records.values() if round in lines}
        assert len(hashes) == 1, round
    found = re.search(r"joined at round (\d+) from peer (\d+)'s state (\w+)", caplog.text)
    assert found and int(found[1]) == joined
    assert found[3] == records[int(found[2])][joined - 1]["state_hash"]
    assert records[0][ROUNDS - 1]["epoch"] >= 3  # the join, the leave, the kill
    lines = [json.loads(line) for line in (tmp_path / "membership.jsonl").open()]
    assert [(line["event"], line["rank"], line["round"]) for line in lines] == [
        ("join", 7, 4), ("leave", 3, 10), ("kill", 5, 16)]
    assert [line["time"] for line in lines] == sorted(line["time"] for line in lines)
    assert lines[-1]["time"] <= run.virtual_s  # virtual seconds


def test_the_simulator_does_the_launch_schedule():
    """One parser, one membership record: the simulator's schedule is launch's."""
    assert issubclass(SimChurn, Schedule)
    schedule = Schedule(parse("kill:1@3,join@2", 3), None)
    assert schedule.due(2, lambda rank: None) == [Event("join", 3, 2)]
    assert schedule.due(9, lambda rank: 2) == []  # rank 1 recorded 2 rounds only
    assert schedule.due(9, lambda rank: float("inf")) == [Event("kill", 1, 3)]  # it ended


def test_simulate_churn_refusals_are_launchs_one_lines(tmp_path):
    runner = CliRunner()
    for args, says in [
            (["--churn", "join@3"], "--churn: only with --elastic"),
            (["--churn", "kill:9@3", "--elastic", "--strategy", "ring-allreduce"],
             "--churn: kill:9@3: no rank 9"),
            (["--churn", "join@3", "--elastic", "--strategy", "dpsgd", "--option",
              "staleness=2"], "survives_death"),
            (["--churn", "join@3", "--elastic", "--strategy", "ring-allreduce",
              "--sizes-only"], "--sizes-only: --elastic is not simulated")]:
        out = runner.invoke(main, ["simulate", "--peers", "3", "--quiet", "--run-dir",
                                   str(tmp_path / "run"), *args])
        assert out.exit_code != 0 and says in out.output, (args, out.output)
        assert len(out.output.strip().splitlines()) == 1 or "simulated peers" in out.output
    assert not (tmp_path / "run" / "membership.jsonl").exists()


def test_sizes_only_refuses_elastic_in_one_line():
    config = TrainConfig.from_dict({"strategy": "ring-allreduce", "rounds": 2,
                                    "elastic": True})
    with pytest.raises(ConfigError, match="^--sizes-only: --elastic is not simulated") as info:
        simulate_sizes(config, Topology.generate("ring", 3), Simulation(sizes_only=True))
    assert "\n" not in str(info.value)


def test_simulate_churn_prints_the_events_and_plots_the_members(tmp_path):
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(main, [
        "simulate", "--peers", "4", "--rounds", "12", "--strategy", "ring-allreduce",
        "--elastic", "--churn", "join@2,leave:1@5,kill:2@8", "--dead-after", "0.5",
        "--compute-delay", "0.1", "--batch-size", "8", "--quiet", "--run-dir", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert ("churn: 1 join (peer 4 at round 2), 1 leave (peer 1 at round 5), 1 kill (peer 2 "
            "at round 8)") in out.output
    assert "peer 2 died (killed by SIGKILL, injected)" in out.output
    out = CliRunner().invoke(main, ["plot", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert (run_dir / "peers_vs_round.png").exists()


def test_a_dpsgd_joiner_too_late_for_the_run_ends_cleanly(tmp_path):
    """dpsgd on a ring of 6: a view activates 2 diam + 2 = 8 rounds after its proposal, so a
    join asked in round 10 of 12 is never admitted. The members tell it the run ended
    (``ctl.end``) as they close: it runs no round and the run exits 0, although the member
    that left before it asked never says goodbye to it."""
    run_dir = tmp_path / "run"
    out = CliRunner().invoke(main, [
        "simulate", "--peers", "6", "--rounds", "12", "--strategy", "dpsgd", "--elastic",
        "--churn", "leave:2@3,join@10", "--dead-after", "0.5", "--compute-delay", "0.1",
        "--batch-size", "8", "--quiet", "--run-dir", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert "1 join (peer 6 at round 10)" in out.output
    assert not (run_dir / "peer-6.jsonl").exists() \
        or not (run_dir / "peer-6.jsonl").read_text().strip()


def test_the_oracle_probe_meets_the_views_members(tmp_path):
    """``--probe oracle`` in an elastic run: a probe meets the view's members, not every
    rank of the topology (a spare not admitted yet never comes: each probe sat out the
    timeout); after the join it counts the joiner too."""
    config = TrainConfig.from_dict({"strategy": "dpsgd", "rounds": 12, "batch_size": 8,
                                    "seed": 3, "elastic": True, "spares": 1, "eval_every": 3,
                                    "timeout": 20, "delays": {"compute": 0.1}})
    run = simulate_run(config, Topology.generate("ring", 5), tmp_path,
                       Simulation(probe="oracle"), churn=parse("join@1", 4))
    assert run.failed == {} and run.virtual_s < 10
    records = {line["round"]: line for line in run.records[0]}
    assert records[3]["consensus"] is not None and records[11]["consensus"] is not None
    assert len(run.records[4]) > 0
