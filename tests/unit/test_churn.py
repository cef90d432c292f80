"""`gossip launch --churn`: the schedule's parsing and its one-line errors."""

from __future__ import annotations

import pytest

from gossip.errors import ConfigError
from gossip.launching.churn import Event, joiners, joins_in, parse


def test_a_schedule_in_round_order_joiners_on_the_spare_ranks():
    events = parse("kill:5@30, join@10,leave:3@20,join@12", 6)
    assert events == [Event("join", 6, 10), Event("join", 7, 12), Event("leave", 3, 20),
                      Event("kill", 5, 30)]
    assert joiners(events) == [6, 7] and joins_in("join@10,leave:3@20,join@12") == 2
    assert parse("join@1,kill:5@3", 5) == [Event("join", 5, 1), Event("kill", 5, 3)]


@pytest.mark.parametrize("text, says", [
    ("join10", "is not ACTION[:RANK]@ROUND"), ("leave:3@0", "ROUND >= 1"),
    ("quit:3@5", "'quit' in 'quit:3@5' is not one of join, leave, kill"),
    ("join:4@5", "a join takes no rank"), ("kill@5", "names no rank"),
    ("kill:9@5", "no rank 9 (ranks 0..4"), ("leave:1@5,kill:1@9", "twice"),
    ("kill:0@2,kill:1@2", "every peer"), ("", "is not ACTION")])
def test_bad_schedules_are_refused_in_one_line(text, says):
    with pytest.raises(ConfigError) as info:
        parse(text, 2 if "every" in says else 5)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("--churn: ")


def test_launch_refuses_churn_without_elastic_or_with_a_strategy_that_cannot_join(tmp_path):
    from click.testing import CliRunner

    from gossip.cli import main

    runner = CliRunner()
    out = runner.invoke(main, ["launch", "--churn", "join@3", "--run-dir", str(tmp_path / "a")])
    assert out.exit_code != 0 and "--churn: only with --elastic" in out.output
    out = runner.invoke(main, ["launch", "--churn", "join@3", "--elastic", "--strategy", "dpsgd",
                               "--option", "staleness=2", "--run-dir", str(tmp_path / "b")])
    assert out.exit_code != 0 and "survives_death" in out.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_churn_runs_curve_counts_each_rounds_peers(tmp_path):
    """Rows by round, each with the peers that ran it (a joiner's first round is not row 0)."""
    import json

    from gossip.experiment.analysis import load_curve

    ran = {0: range(5), 1: range(3), 2: range(2, 5)}  # 1 leaves after 2, 2 joins at 2
    for rank, rounds in ran.items():
        with open(tmp_path / f"peer-{rank}.jsonl", "w") as out:
            for r in rounds:
                out.write(json.dumps({"round": r, "time": r - rounds[0] + 1.0,
                                      "wall": 100.0 + r, "loss": 1.0, "accuracy": 0.5,
                                      "bytes_sent": 10 * r, "minibatches": 1,
                                      "samples": 32}) + "\n")
    (tmp_path / "membership.jsonl").write_text('{"event": "join"}\n')
    curve = load_curve(tmp_path)
    assert curve.peers.tolist() == [2, 2, 3, 2, 2] and curve.rounds.tolist() == list(range(5))
    assert curve.time.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_random_schedule_draws_its_share_every_period_with_the_seed():
    from collections import Counter

    from gossip.launching.churn import expand

    text = expand("random:10%/100", 1000, 300, 7)
    events = parse(text, 1000)
    assert text == expand("random:10%/100", 1000, 300, 7) != expand("random:10%/100", 1000,
                                                                    300, 8)
    assert Counter(e.action for e in events) == {"join": 150, "leave": 75, "kill": 75}
    for start in (0, 100, 200):  # 50 joins and 50 departures in every 100 rounds
        assert sum(start < e.round <= start + 100 for e in events) == 100
    assert max(e.round for e in events) <= 297  # a join is admitted before the end
    joined = {e.rank: e.round for e in events if e.action == "join"}
    for e in events:  # a joiner leaves only in a later period than its join's
        if e.action != "join" and e.rank in joined:
            assert (e.round - 1) // 100 > (joined[e.rank] - 1) // 100
    assert expand("join@3", 4, 10, 0) == "join@3"


@pytest.mark.parametrize("text", ["random:10/100", "random:10%", "random:0%/10",
                                  "random:x%/10", "random:10%/0"])
def test_bad_random_schedules_are_refused_in_one_line(text):
    from gossip.launching.churn import expand

    with pytest.raises(ConfigError, match=r"^--churn: .* is not random:PCT%/ROUNDS"):
        expand(text, 10, 100, 0)


def test_a_joiner_still_waiting_when_the_members_ended_is_asked_to_leave(tmp_path):
    """`launch`'s schedule SIGTERMs (a leave: the joiner gives up, exits 0) a joiner that
    recorded no round once every peer that trained has ended: its process may start
    after the members closed, and then nobody answers its asks."""
    import json
    import signal
    import subprocess
    import sys

    from gossip.launching.churn import Churn
    from gossip.launching.processes import PeerProcess

    def process(rank, rounds, alive):
        metrics = tmp_path / f"peer-{rank}.jsonl"
        metrics.write_text("".join(json.dumps({"round": r}) + "\n" for r in range(rounds)))
        code = "import time; time.sleep(60)" if alive else "pass"
        popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        if not alive:
            popen.wait()
        return PeerProcess(rank, popen, tmp_path / f"peer-{rank}.log", metrics)

    member, joiner = process(0, 5, alive=True), process(1, 0, alive=True)
    churn = Churn(parse("join@3", 1), lambda rank: joiner, tmp_path / "membership.jsonl")
    procs = [member]
    churn.tick(procs)  # the join is due: its process starts; the member still runs
    assert procs == [member, joiner] and joiner.process.poll() is None
    churn.tick(procs)
    assert joiner.process.poll() is None and not churn.released
    member.process.kill()
    member.process.wait()
    churn.tick(procs)
    assert churn.released == {1} and joiner.process.wait(10) == -signal.SIGTERM
