"""Flags whose default a module declares take it from there (``declared_option``): the
help shows it, an unset flag gets it, and a change in the declaration reaches both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gossip.cli import main
from gossip.cli.common import declared, declared_option

ROOT = Path(__file__).resolve().parents[2]
SERVER = "gossip.crossover.server:ArbiterServer"
NETWORK = "gossip.sim.network:NetworkModel"
FLAGS = [  # command, flag, the declaration
    (["arbiter"], "--patience", SERVER, "patience_s"),
    (["arbiter"], "--max-hold", SERVER, "max_hold_s"),
    (["arbiter"], "--dead-after", SERVER, "dead_after"),
    (["simulate"], "--latency", NETWORK, "latency"),
    (["simulate"], "--sharing", NETWORK, "sharing"),
    (["simulate"], "--message-cost", NETWORK, "message_s"),
    (["simulate"], "--byte-cost", NETWORK, "byte_s"),
    (["simulate"], "--probe", "gossip.sim.runner:Simulation", "probe"),
    (["sim-fit"], "--latency", NETWORK, "latency"),
    (["bench", "sparse"], "--reps", "gossip.bench.sparse:run", "reps"),
    (["bench", "sparse"], "--warmup", "gossip.bench.sparse:run", "warmup"),
    (["bench", "sparse"], "--indices", "gossip.bench.sparse:run", "indices"),
    (["bench", "compress"], "--reps", "gossip.bench.compress:run", "reps"),
    (["bench", "soak"], "--warmup", "gossip.bench.soak:soak", "warmup"),
]


def shown(command: list[str]) -> str:
    output = CliRunner().invoke(main, [*command, "--help"], terminal_width=1000).output
    return " ".join(output.split())


@pytest.mark.parametrize("command, flag, source, field", FLAGS)
def test_the_help_shows_the_declared_default(command, flag, source, field):
    text = shown(command)
    after = text[text.index(flag + " ") + len(flag):]
    own = after[:after.index(" --")]  # this flag's help, up to the next flag
    default = declared(source, field)
    assert own.endswith(f"[default: {default}]"), (flag, default, own)


def test_a_default_changed_in_the_declaration_reaches_the_help_and_the_value(monkeypatch):
    from gossip.crossover.server import ArbiterServer

    monkeypatch.setattr(ArbiterServer.__init__, "__kwdefaults__",
                        {**ArbiterServer.__init__.__kwdefaults__, "dead_after": 7.5})
    assert "Drop a client silent this long while the device waits for it. [default: 7.5]" \
        in shown(["arbiter"])

    @click.command()
    @declared_option("--dead-after", source=SERVER, field="dead_after", type=float)
    def command(dead_after):
        click.echo(repr(dead_after))

    assert CliRunner().invoke(command, []).output == "7.5\n"
    assert CliRunner().invoke(command, ["--dead-after", "3"]).output == "3.0\n"


def test_declared_defaults_are_read_only_when_needed():
    """`gossip --help` does not import the declaring modules (zmq, torch)."""
    code = ("import sys, gossip.cli; loaded = {'zmq', 'torch', 'gossip.sim', "
            "'gossip.crossover.server', 'gossip.bench.sparse'} & set(sys.modules); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
