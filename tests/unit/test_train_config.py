"""TrainConfig's fields are declared once (option(default, doc, check)): the CLI flags, their
help and every default come from there, and the strategy's options are parsed once."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gossip import Peer, Topology, TrainConfig
from gossip.cli import main
from gossip.cli.flags import delay_flags, field_flags, train_config
from gossip.errors import ConfigError
from gossip.faults import DelayConfig
from gossip.matrix import check_run
from gossip.strategies import STRATEGIES, option

ROOT = Path(__file__).resolve().parents[2]
DPSGDOptions = STRATEGIES.entry("dpsgd").options
SCALARS = [f for f in dataclasses.fields(TrainConfig)  # sections have flags of their own
           if f.name not in ("options", "task_options", "delays", "attack")]


def help_of(flags) -> str:
    command = click.Command("command", params=flags, callback=lambda **_: None)
    return " ".join(CliRunner().invoke(command, ["--help"], terminal_width=1000).output.split())


@pytest.mark.parametrize("command", ["peer", "launch", "simulate"])
def test_every_scalar_field_is_a_flag_with_its_doc_and_default(command):
    shown = " ".join(CliRunner().invoke(main, [command, "--help"],
                                        terminal_width=1000).output.split())
    defaults = TrainConfig()
    for spec in SCALARS:
        flag = "--" + spec.name.replace("_", "-")
        assert flag in shown
        assert spec.metadata["doc"] in shown, spec.name
        value = getattr(defaults, spec.name)
        if spec.name != "strategy":  # empty: the default strategy
            text = str(value).lower() if isinstance(value, bool) else f"{value:g}" \
                if isinstance(value, float) else str(value)
            assert f"{spec.metadata['doc']} [default: {text}]" in shown, spec.name


@pytest.mark.parametrize("declared, make_flags, name, flag", [
    (TrainConfig, field_flags, "dead_after", "--dead-after FLOAT"),
    (DelayConfig, delay_flags, "straggler_mean", "--straggler-mean FLOAT"),
])
def test_a_default_changed_in_its_declaration_reaches_the_flags_and_the_config(
        declared, make_flags, name, flag):
    changed = dataclasses.make_dataclass(
        "Changed", [(name, float, option(7.5, "Seconds, changed."))], bases=(declared,),
        frozen=True)
    assert getattr(changed(), name) == 7.5
    assert f"{flag} Seconds, changed. [default: 7.5]" in help_of(make_flags(changed))


@pytest.mark.parametrize("command", ["peer", "launch", "simulate"])
def test_every_delay_field_is_a_flag_with_its_doc_and_default(command):
    shown = " ".join(CliRunner().invoke(main, [command, "--help"],
                                        terminal_width=1000).output.split())
    for flag, field in (("--compute-delay FLOAT", "compute"), ("--slowdown RANK:VALUE", "slowdown"),
                        ("--straggler-prob FLOAT", "straggler_prob"),
                        ("--straggler-mean FLOAT", "straggler_mean"),
                        ("--send-delay [RANK:]VALUE", "send_delay"),
                        ("--delay-seed INTEGER", "seed")):
        doc = DelayConfig.__dataclass_fields__[field].metadata["doc"]
        assert f"{flag} {doc}" in shown, field
    assert "straggler delay. [default: 0]" in shown


@pytest.mark.parametrize("flags, culprit", [
    (dict(compute_delay=-1.0), "command line: delays.compute: -1.0 must be a finite number >= 0"),
    (dict(slowdown=("1:0.5",)), "command line: delays.slowdown: {1: 0.5} gives rank 1 0.5"),
    (dict(send_delay=("x",)), "--send-delay 'x': expected a number"),
    (dict(straggler_prob=2.0), "command line: delays.straggler_prob: 2.0 must be in [0, 1]"),
])
def test_bad_delay_flags_are_one_config_error_line(flags, culprit):
    with pytest.raises(ConfigError) as info:
        train_config(None, (), **flags)
    assert culprit in str(info.value) and "\n" not in str(info.value)


def test_peer_and_the_config_share_each_default():
    peer = inspect.signature(Peer).parameters
    attach = inspect.signature(Peer.attach).parameters
    config = TrainConfig()
    assert peer["timeout"].default == config.timeout
    assert peer["dead_after"].default == config.dead_after
    assert attach["bucket_mb"].default == config.bucket_mb


def test_the_cli_starts_without_the_training_stack():
    """`gossip --help` and the commands without training flags do not pay torch's import."""
    code = "import sys, gossip.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_unset_flags_keep_the_config_file(tmp_path):
    (tmp_path / "c.yaml").write_text("train: {rounds: 7, dead_after: 2.5}\n")
    config = train_config(str(tmp_path / "c.yaml"), (), rounds=None, dead_after=None, lr=0.5)
    assert (config.rounds, config.dead_after, config.lr) == (7, 2.5, 0.5)


@pytest.fixture
def parses(monkeypatch):
    """How many times DPSGDOptions were parsed (built)."""
    count = [0]
    parse = DPSGDOptions.__post_init__

    def counted(self):
        count[0] += 1
        parse(self)

    monkeypatch.setattr(DPSGDOptions, "__post_init__", counted)
    return count


def test_the_strategy_options_are_parsed_once(parses):
    config = TrainConfig(strategy="dpsgd", options={"staleness": 0}, rounds=3)
    assert parses[0] == 1
    assert config.spec.options.staleness == 0 and not config.asynchronous
    topology = Topology.ring(2)
    check_run(config, topology)
    Peer(0, topology, config.spec)
    STRATEGIES.resolve(config.spec)
    assert parses[0] == 1


def test_a_peer_given_a_name_parses_its_options_once(parses):
    Peer(0, Topology.ring(2), "dpsgd", staleness=0)
    assert parses[0] == 1


def test_a_spec_takes_no_more_options():
    spec = TrainConfig().spec
    with pytest.raises(ConfigError, match="options staleness given with a resolved strategy"):
        STRATEGIES.resolve(spec, {"staleness": 1})


def test_a_spec_retagged_keeps_its_options():
    spec = TrainConfig(options={"staleness": 1}).spec
    other = spec.retagged("gossip.b1")
    assert (other.tag, other.options.staleness, other.cls) == ("gossip.b1", 1, spec.cls)


@pytest.mark.parametrize("given, line", [
    ({"rounds": 0}, "rounds: 0 must be >= 1"),
    ({"momentum": 1.0}, "momentum: 1.0 must be in [0, 1)"),
    ({"partition": "zipf"}, "partition: 'zipf' must be one of iid, dirichlet"),
    ({"rounds": "many"}, "rounds: 'many' must be an integer"),
    ({"options": {"nope": 1}}, "strategy 'dpsgd' has no option 'nope'"),
])
def test_a_bad_value_is_one_config_error_line(given, line):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**given)
    assert line in str(error.value) and "\n" not in str(error.value)


def test_a_bad_flag_is_one_line_and_exit_1():
    result = CliRunner().invoke(main, ["launch", "--peers", "2", "--momentum", "1"])
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: command line: momentum: 1.0 must be in [0, 1)"
