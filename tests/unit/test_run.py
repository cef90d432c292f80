"""The run launcher shared by `gossip launch` and `gossip experiment run`: what it writes in
the run directory, what it starts, what it reports. Peers are faked (no process starts):
each fake peer writes one record, as a finished peer would."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from gossip.cli import main
from gossip.cluster import parse_rate
from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.experiment import load_experiment, run_experiment
from gossip.launching import processes as launch
from gossip.launching import plan as run_module
from gossip.launching.plan import launch_run
from gossip.metrics import MetricsWriter
from gossip.topology import Topology
from gossip.training.records import Record

CONFIG = TrainConfig(rounds=2, batch_size=16)


class FakePeers:
    """Stands in for ``launch.start_peers`` and ``launch.watch``; remembers the calls and
    reports ``deaths`` as the watch's."""

    def __init__(self):
        self.started: list[tuple[list[int], list[str], list[list[str]]]] = []  # ranks, args, argv
        self.deaths: list[launch.Death] = []
        self.events: list[str] = []

    def start_peers(self, ranks, run_dir, extra_args, *, wrap=None, spawn=None):
        self.events.append("start")
        argv = [wrap(r, ["gossip", "peer"]) if wrap else ["gossip", "peer"] for r in ranks]
        self.started.append((list(ranks), list(extra_args), argv))
        for rank in ranks:
            with MetricsWriter(run_dir / f"peer-{rank}.jsonl") as metrics:
                metrics.write(Record(round=0, time=0.1, wall=0.0, loss=0.5, accuracy=0.9,
                                     bytes_sent=10, bytes_recv=10, compute_s=0.0,
                                     delay_s=0.0, comm_s=0.0, wait_s=0.0, minibatches=1,
                                     samples=16, consensus=0.0, avg_accuracy=0.9).as_dict())
        return list(ranks)

    def watch(self, procs, on_progress, on_death=None, *, asynchronous=False):
        on_progress(len(procs))
        for death in self.deaths:
            on_death(death)
        return self.deaths


@pytest.fixture
def peers(monkeypatch) -> FakePeers:
    fake = FakePeers()
    monkeypatch.setattr(launch, "start_peers", fake.start_peers)
    monkeypatch.setattr(launch, "watch", fake.watch)
    return fake


class FakeCluster:
    """A virtual cluster without namespaces: rank r at 10.9.0.(r+1)."""

    def __init__(self, size, *, rate):
        self.size, self.rate, self.open = size, parse_rate(rate), False

    def __enter__(self):
        self.open = True
        return self

    def __exit__(self, *exc):
        self.open = False

    def relocate(self, topology):
        data = topology.to_dict()
        return Topology.from_dict({**data, "peers": [
            {**peer, "host": f"10.9.0.{peer['rank'] + 1}"} for peer in data["peers"]]})

    def command(self, rank, argv):
        assert self.open, "a peer started outside the cluster's lifetime"
        return ["netns", str(rank), *argv]

    def describe(self):
        return f"fake cluster, {self.rate} per link each way"


def topology(size: int = 3) -> Topology:
    return Topology.generate("ring", size, host="127.0.0.1", base_port=47000)


def test_the_run_directory_holds_topology_and_config(tmp_path, peers):
    ready = []
    result = launch_run(CONFIG, topology(), tmp_path / "run", peer_args=["--resume"],
                        on_ready=lambda placement: (ready.append(placement),
                                                    peers.events.append("ready")))
    run_dir = tmp_path / "run"
    assert Topology.from_yaml(run_dir / "topology.yaml").to_dict() == topology().to_dict()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert list(config) == ["train", "topology", "ranks"]
    assert TrainConfig.from_dict(config["train"]) == CONFIG
    assert config["topology"] == topology().to_dict() and config["ranks"] == [0, 1, 2]
    # Every peer reads both files, then the extra flags.
    assert peers.started[0][1] == ["--topology", str(run_dir / "topology.yaml"),
                                   "--config", str(run_dir / "config.yaml"), "--resume"]
    assert peers.events == ["ready", "start"]  # announced with its directory written
    assert ready[0].run_dir == run_dir and ready[0].cluster is None
    assert (result.run_dir, result.ranks, result.deaths) == (run_dir, [0, 1, 2], [])
    assert result.seconds >= 0


def test_extra_entries_come_after_the_ranks_and_the_link_rate_last(tmp_path, peers,
                                                                   monkeypatch):
    monkeypatch.setattr(run_module, "VirtualCluster", FakeCluster)
    result = launch_run(CONFIG, topology(), tmp_path, rate="100mbit",
                        extra_config={"run": "fast"})
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert list(config) == ["train", "topology", "ranks", "run", "netns"]
    assert config["run"] == "fast" and config["netns"] == {"rate": "100mbit"}
    assert [p["host"] for p in config["topology"]["peers"]] == ["10.9.0.1", "10.9.0.2",
                                                                "10.9.0.3"]
    assert result.ranks == [0, 1, 2]
    assert [argv[:2] for argv in peers.started[0][2]] == [["netns", "0"], ["netns", "1"],
                                                          ["netns", "2"]]


def test_deaths_are_reported_and_returned(tmp_path, peers):
    death = launch.Death(rank=2, code=-9, rounds=1, last_line="")
    peers.deaths = [death]
    reported = []
    result = launch_run(CONFIG, topology(), tmp_path, progress="dpsgd",
                        on_death=reported.append)
    assert reported == result.deaths == [death]


def test_a_death_fails_the_run_unless_injected_or_tolerated():
    """The one rule of launch, simulate and experiment runs (they exited 0 when a peer died
    with an error, provided one finished)."""
    crash = launch.Death(rank=3, code=1, rounds=4, last_line="RuntimeError: boom")
    killed = launch.Death(rank=1, code=-9, rounds=2, last_line="", injected=True)
    launch.check_deaths([])
    launch.check_deaths([killed])  # a fault the run injected itself
    with pytest.raises(launch.LaunchFailed) as info:
        launch.check_deaths([killed, crash])
    assert str(info.value) == ("1 peer(s) died: peer 3 died (exit code 1) after 4 round(s): "
                               "RuntimeError: boom")
    assert info.value.rank == 3
    launch.check_deaths([killed, crash], tolerate=1)
    with pytest.raises(launch.LaunchFailed, match="2 peer.s. died, more than the 1 tolerated"):
        launch.check_deaths([crash, launch.Death(rank=0, code=-15, rounds=0, last_line="")],
                            tolerate=1)


def test_an_asynchronous_death_counts_steps_and_samples():
    records = [{"round": r, "samples": 16} for r in range(5)]
    death = launch.Death(rank=2, code=-9, last_line="",
                         **launch.progress(records, asynchronous=True))
    assert death.describe() == "peer 2 died (killed by SIGKILL) after 5 step(s), 80 samples"
    assert launch.progress([], asynchronous=False) == {"rounds": 0, "samples": None}


@pytest.mark.parametrize("tolerate, code", [(None, 1), ("1", 0)])
def test_launch_exits_non_zero_when_a_peer_died(tmp_path, peers, tolerate, code):
    peers.deaths = [launch.Death(rank=2, code=1, rounds=1, last_line="RuntimeError: boom")]
    cli = CliRunner().invoke(main, ["launch", "--peers", "3", "--rounds", "2", "--run-dir",
                                    str(tmp_path),
                                    *(["--tolerate-deaths", tolerate] if tolerate else [])])
    assert cli.exit_code == code, cli.output
    assert "peer 2 died (exit code 1) after 1 round(s): RuntimeError: boom" in cli.output
    assert "mean test accuracy" in cli.output  # the table of the others first
    if code:
        assert cli.output.rstrip().splitlines()[-1] == (
            f"error: 1 peer(s) died: peer 2 died (exit code 1) after 1 round(s): "
            f"RuntimeError: boom; logs in {tmp_path}")


def test_no_local_rank_is_one_config_error_and_nothing_starts(tmp_path, peers):
    remote = Topology.generate("ring", 2, host="192.0.2.1")
    with pytest.raises(ConfigError, match="no peer of the topology runs on this machine"):
        launch_run(CONFIG, remote, tmp_path)
    assert peers.started == []


def test_launch_and_an_experiment_run_write_the_same_config_layout(tmp_path, peers):
    cli = CliRunner().invoke(main, ["launch", "--peers", "3", "--rounds", "2",
                                    "--batch-size", "16", "--run-dir",
                                    str(tmp_path / "launch")])
    assert cli.exit_code == 0, cli.output
    assert f"3 peers, ring-3, strategy dpsgd, 2 rounds -> {tmp_path / 'launch'}" in cli.output
    assert cli.output.rstrip().endswith(f"run directory: {tmp_path / 'launch'}")
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({
        "name": "same", "peers": 3, "graph": "ring",
        "train": {"rounds": 2, "batch_size": 16}, "runs": [{"name": "one"}]}))
    assert run_experiment(load_experiment(tmp_path / "exp.yaml"), tmp_path / "exp",
                          echo=lambda line: None, progress=False) == []

    launched = yaml.safe_load((tmp_path / "launch" / "config.yaml").read_text())
    experiment = yaml.safe_load((tmp_path / "exp" / "one" / "config.yaml").read_text())
    assert list(experiment) == list(launched) + ["run"] and experiment["run"] == "one"
    assert launched["train"] == experiment["train"]  # same settings, resolved the same way
    assert _portless(launched["topology"]) == _portless(experiment["topology"])
    assert launched["ranks"] == experiment["ranks"]
    # Both runs started their peers the same way.
    (_, launch_args, _), (_, run_args, _) = peers.started
    assert [arg.replace(str(tmp_path / "launch"), "DIR") for arg in launch_args] == [
        arg.replace(str(tmp_path / "exp" / "one"), "DIR") for arg in run_args]


def test_launch_flags_reach_the_peers_config(tmp_path, peers):
    """--snapshot-seconds had no flag and --lr 0 (pure gossip) was refused."""
    cli = CliRunner().invoke(main, ["launch", "--peers", "3", "--strategy", "adpsgd",
                                    "--rounds", "2", "--lr", "0", "--snapshot-seconds", "0.5",
                                    "--run-dir", str(tmp_path)])
    assert cli.exit_code == 0, cli.output
    train = yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]
    assert (train["lr"], train["snapshot_seconds"]) == (0, 0.5)


@pytest.mark.parametrize("args, size, degree", [
    (["--graph-option", "rows=3", "--graph-option", "cols=5"], 15, 4),  # the size implied
    (["--peers", "6", "--graph-option", "rows=2", "--graph-option", "cols=3"], 6, 3)])
def test_launch_takes_a_generators_parameters(tmp_path, peers, args, size, degree):
    cli = CliRunner().invoke(main, ["launch", "--graph", "torus", *args, "--rounds", "1",
                                    "--run-dir", str(tmp_path / "run")])
    assert cli.exit_code == 0, cli.output
    assert f"{size} peers, torus-{size}, strategy dpsgd" in cli.output
    written = Topology.from_yaml(tmp_path / "run" / "topology.yaml")
    assert {d for _, d in written.graph.degree()} == {degree}


@pytest.mark.parametrize("args, message", [
    (["--graph", "torus"], "--graph torus: missing parameter 'rows' (--graph-option KEY=VALUE"),
    (["--graph", "torus", "--peers", "5", "--graph-option", "rows=2", "--graph-option",
      "cols=3"], "--graph torus: rows*cols = 2x3 = 6 does not match n = 5"),
    (["--graph", "ring", "--graph-option", "rows=2"], "ring: unexpected parameter 'rows'"),
    (["--graph", "erdos_renyi", "--graph-option", "p"], "--graph-option 'p': expected KEY=VALUE")])
def test_launch_names_a_bad_graph_parameter_before_starting(tmp_path, peers, args, message):
    cli = CliRunner().invoke(main, ["launch", *args, "--run-dir", str(tmp_path / "run")])
    assert cli.exit_code == 1 and peers.started == []
    assert message in cli.output and cli.output.count("\n") == 1


def _portless(topology: dict) -> dict:
    """The topology without its ports (free ones, found anew for each run)."""
    return {**topology, "peers": [{k: v for k, v in peer.items() if k != "port"}
                                  for peer in topology["peers"]]}


def test_an_experiment_of_sizes_only_runs_ends_with_where_their_times_are(tmp_path):
    """Sizes-only runs record no training curves: no plot step to fail, a pointer instead."""
    spec = tmp_path / "so.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "so", "graph": "ring", "simulate": {"rate": "1gbit", "sizes_only": True},
        "train": {"rounds": 2, "batch_size": 16, "delays": {"compute": 0.001}},
        "runs": [{"name": "ring-3", "strategy": "ring-allreduce", "peers": 3}]}))
    out = tmp_path / "out"
    cli = CliRunner().invoke(main, ["experiment", "run", str(spec), "--out", str(out)])
    assert cli.exit_code == 0, cli.output
    assert f"gossip sim-scaling {out}" in cli.output
    assert (out / "ring-3" / "sizes.json").exists()


def test_the_progress_bar_counts_only_ranks_that_train(tmp_path, peers, monkeypatch, capsys):
    """Servers only (topology roles) run no rounds: with every worker done the bar is full."""
    data = topology(5).to_dict()
    del data["edges"]  # implied: every worker linked to every server
    roles = Topology.from_dict({**data, "servers": [3, 1]})
    monkeypatch.setattr(launch, "watch", lambda procs, on_progress, on_death=None, **_:
                        on_progress(CONFIG.rounds * 3) or [])
    config = TrainConfig(rounds=CONFIG.rounds, batch_size=16, strategy="ps")
    launch_run(config, roles, tmp_path, progress="ps", on_death=lambda death: None)
    assert "100%" in capsys.readouterr().err.split("\r")[-1]


def test_the_summary_of_a_run_where_no_peer_finished_training_names_the_deaths(tmp_path):
    """Every worker died and the parameter server finished: no table, the deaths."""
    from gossip.cli.summary import run_summary

    deaths = [launch.Death(rank=r, code=-9, rounds=2, last_line="") for r in (1, 2)]
    summary = run_summary(tmp_path, [0, 1, 2], deaths)
    assert summary.splitlines() == ["no peer finished training", deaths[0].describe(),
                                    deaths[1].describe()]


def test_the_summary_mean_accuracy_skips_a_last_record_not_scored(tmp_path):
    """With --test-every, a peer that left between scored rounds has no accuracy last."""
    import json

    from gossip.cli.summary import run_summary

    for rank, accuracy in ((0, 0.5), (1, None), (2, 0.7)):
        line = {"round": 3, "loss": 0.1, "accuracy": accuracy, "bytes_sent": 1,
                "bytes_recv": 1, "time": 1.0, "consensus": None, "lost_peers": {}}
        (tmp_path / f"peer-{rank}.jsonl").write_text(json.dumps(line) + "\n")
    assert "mean test accuracy 0.6000" in run_summary(tmp_path, [0, 1, 2])
