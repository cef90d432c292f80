"""The compatibility matrix (gossip/matrix.py): one check, run by every entry before any
socket opens, its one-line refusals, and docs/MATRIX.md generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gossip import matrix
from gossip.cli.strategies import strategies
from gossip.config import TrainConfig
from gossip.errors import ConfigError
from gossip.ports import free_ports
from gossip.peer import Peer
from gossip.sim import simulate_run
from gossip.strategies import STRATEGIES
from gossip.topology import Topology

ROOT = Path(__file__).resolve().parents[2]


def one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text, text
    return text


def gossip_cli(*args: str, cwd: Path):
    """`gossip ARGS` run in ``cwd``, in-process (each refusal comes before any peer starts:
    a process would only add the interpreter's and torch's start-up), with ``returncode``,
    ``stdout`` and ``stderr`` as a finished process has them."""
    from click.testing import CliRunner

    from gossip.cli import main

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        result = CliRunner().invoke(main, list(args))
    result.returncode = result.exit_code
    return result


def error_line(result) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def servers_topology(tmp_path: Path) -> Path:
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"size": 3, "base_port": free_ports(3)[0], "servers": [0]}))
    return path


# -- the docs table is the code's -------------------------------------------------------
def test_docs_matrix_is_what_the_code_generates():
    """docs/MATRIX.md is `gossip strategies --matrix`; regenerate it with
    `python -m gossip strategies --matrix > docs/MATRIX.md`."""
    from click.testing import CliRunner

    printed = CliRunner().invoke(strategies, ["--matrix"])
    assert printed.exit_code == 0, printed.output
    assert printed.output == matrix.markdown()
    assert (ROOT / "docs" / "MATRIX.md").read_text() == printed.output


def test_every_strategy_and_mode_is_a_row_and_a_column():
    labels = [row.label for row in matrix.rows()]
    assert set(STRATEGIES.names()) <= set(labels)
    wrappers = [f.wrapper for f in matrix.features() if f.wrapper]
    assert sorted(wrappers) == ["local", "nonblocking"]
    for wrapper in wrappers:  # each with every inner it accepts, and only those
        accepted = {row.options["inner"] for row in matrix.rows() if row.strategy == wrapper
                    and "inner" in row.options}
        for name in STRATEGIES.names():
            try:
                STRATEGIES.options(wrapper, {"inner": name})
            except ConfigError:
                assert name not in accepted
            else:
                assert name in accepted


# -- every refused cell is one line, from each entry ----------------------------------------
@pytest.mark.parametrize("row, column", [
    (row, column) for row in matrix.rows() for column in matrix.features()
    if matrix.cell(row, column) is not None],
    ids=lambda v: v.label if isinstance(v, matrix.Row) else v.name)  # stable across processes
def test_a_refused_cell_is_one_config_error_naming_mode_and_strategy(row, column):
    with pytest.raises(ConfigError) as info:
        matrix.check(row.strategy, row.options, {column.name})
    text = one_line(info)
    assert text.startswith(f"{column.flag} with strategy {row.strategy}: ")
    assert matrix.cell(row, column) in text


# -- bug 1: local wrapping nonblocking ---------------------------------------------------
def test_local_wrapping_nonblocking_is_refused_in_one_line_not_a_traceback():
    """It was an AttributeError (NonBlocking's capabilities are set per instance, not on
    the class) in a 47-line traceback."""
    topology = Topology.generate("ring", 3)
    with pytest.raises(ConfigError) as info:
        Peer(0, topology, "local", inner="nonblocking")
    assert one_line(info).startswith("local: inner: 'nonblocking' with these options: it "
                                     "decides at run time when a round ends")


def test_launch_of_local_wrapping_nonblocking_is_one_error_line(tmp_path):
    line = error_line(gossip_cli("launch", "--strategy", "local", "--option", "inner=nonblocking",
                                 "--peers", "3", "--rounds", "1", cwd=tmp_path))
    assert "local: inner: 'nonblocking'" in line


# -- bug 7: server roles with a strategy that has none --------------------------------------
def test_servers_with_a_strategy_that_does_not_serve_are_refused_before_binding(tmp_path):
    """Servers used to exit while the workers waited for them until the timeout."""
    topology = Topology.from_yaml(servers_topology(tmp_path))
    for strategy, options in (("dpsgd", {}), ("ring-allreduce", {}),
                              ("local", {"inner": "dpsgd"})):
        with pytest.raises(ConfigError) as info:
            Peer(1, topology, strategy, **options)
        assert one_line(info).startswith(f"servers: (topology roles) with strategy {strategy}: "
                                         f"it has no server role")
    Peer(1, topology, "ps")  # builds (nothing binds before entering)
    Peer(1, topology, "local", inner="ps")
    with pytest.raises(ConfigError, match="servers: .* with strategy local: it has no server"):
        Peer(1, topology, "local", inner="ps", period=2, group_period=1, groups=[[0], [1, 2]])
    # Roles where every rank also trains leave every rank in the rounds: any strategy.
    both = Topology.from_dict({"peers": [{"rank": r, "host": "127.0.0.1", "port": 1 + r,
                                          "role": "both"} for r in range(3)]})
    Peer(1, both, "dpsgd")


def test_launch_with_servers_and_dpsgd_fails_before_any_peer_starts(tmp_path):
    line = error_line(gossip_cli("launch", "--topology", str(servers_topology(tmp_path)),
                                 "--strategy", "dpsgd", "--rounds", "2", "--timeout", "20",
                                 "--run-dir", "run", cwd=tmp_path))
    assert "servers: (topology roles) with strategy dpsgd" in line
    assert not (tmp_path / "run" / "peer-1.jsonl").exists()  # no peer started


# -- bug 13: wrappers and an asynchronous inner strategy --------------------------------------
def test_nonblocking_refuses_an_asynchronous_inner_strategy():
    """It ran adpsgd in lockstep rounds and ignored the budgets."""
    with pytest.raises(ConfigError) as info:
        Peer(0, Topology.generate("ring", 3), "nonblocking", inner="adpsgd")
    assert one_line(info) == ("nonblocking: inner: 'adpsgd' with these options: it is "
                              "asynchronous: it has no lockstep rounds for the wrapper to close")
    with pytest.raises(ConfigError, match="nonblocking: inner: 'adpsgd'"):
        TrainConfig(strategy="nonblocking", options={"inner": "adpsgd"}, budget_seconds=1.0)


def test_local_over_an_asynchronous_inner_is_asynchronous_and_refuses_lockstep_parts():
    held = matrix.capabilities("local", {"inner": "adpsgd"})
    assert held["synchronous"] is False and held["plans_rounds"] is True
    TrainConfig(strategy="local", options={"inner": "adpsgd", "period": 2}, budget_samples=64)
    for extra in ({"warmup_rounds": 1}, {"group_period": 1}):
        with pytest.raises(ConfigError, match="local: warmup_rounds and group_period average "
                                              "in lockstep rounds"):
            STRATEGIES.options("local", {"inner": "adpsgd", "period": 2, **extra})


# -- bug 22: simulate with overlap ----------------------------------------------------------
def test_simulate_with_overlap_is_refused_at_start(tmp_path):
    """It crashed in the peers ("Cannot switch to a different thread"): overlap's
    communication thread is an OS thread, the simulator's peers are greenlets of one."""
    config = TrainConfig(strategy="ring-allreduce", rounds=1, overlap=True)
    with pytest.raises(ConfigError) as info:
        simulate_run(config, Topology.generate("ring", 3), tmp_path / "run", write=False)
    assert one_line(info).startswith("overlap: True: not simulated")


def test_gossip_simulate_overlap_is_one_error_line(tmp_path):
    line = error_line(gossip_cli("simulate", "--overlap", "--peers", "3", "--rounds", "1",
                                 "--quiet", "--run-dir", "run", cwd=tmp_path))
    assert "overlap: True: not simulated" in line
    assert not (tmp_path / "run").exists()


def test_simulate_refuses_a_shared_device(tmp_path):
    line = error_line(gossip_cli("simulate", "--arbiter", f"flock:{tmp_path}", "--peers", "3",
                                 "--rounds", "1", "--quiet", cwd=tmp_path))
    assert "--arbiter (shared device): not simulated" in line


def test_an_experiment_is_checked_run_by_run_before_its_first_run_starts(tmp_path):
    from gossip.experiment.runner import run_experiment
    from gossip.experiment.spec import parse_experiment

    experiment = parse_experiment({
        "name": "mixed", "peers": 3, "train": {"rounds": 1, "batch_size": 8},
        "runs": [{"name": "fine", "strategy": "dpsgd"},
                 {"name": "bad", "strategy": "dpsgd", "simulate": True, "overlap": True}]})
    with pytest.raises(ConfigError) as info:
        run_experiment(experiment, tmp_path / "out", echo=lambda line: None, progress=False)
    assert one_line(info).startswith("run bad: overlap: True: not simulated")
    assert not (tmp_path / "out").exists()  # not even the first run started


@pytest.mark.parametrize("refused, within", list(matrix.CONFLICTS), ids="-in-".join)
def test_modes_that_exclude_each_other_are_refused_whatever_the_strategy(refused, within):
    for row in matrix.rows():
        with pytest.raises(ConfigError) as info:
            matrix.check(row.strategy, row.options, {refused, within})
        assert one_line(info) == f"{matrix.feature(refused).flag}: " \
                                 f"{matrix.CONFLICTS[refused, within]}"


def test_jobs_sharing_devices_are_checked_before_any_peer_starts(tmp_path):
    """A device's turns go round by round over the jobs (lockstep rounds); an asynchronous
    job has none."""
    from gossip.crossover.jobs import Job, launch_jobs

    ring = Topology.generate("ring", 3)
    jobs = [Job("a", TrainConfig(strategy="dpsgd", rounds=1), ring),
            Job("b", TrainConfig(strategy="adpsgd", rounds=1), ring)]
    with pytest.raises(ConfigError) as info:
        launch_jobs(jobs, tmp_path, mode="flock")
    assert one_line(info).startswith("--arbiter (shared device) with strategy adpsgd: it is "
                                     "asynchronous")
    assert not list(tmp_path.glob("*/config.yaml"))  # no job placed, no peer started
