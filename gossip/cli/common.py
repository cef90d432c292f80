"""The `gossip` command group and what every command shares: clean one-line errors, sizes."""

from __future__ import annotations

import functools
import sys

import click

from gossip.errors import ConfigError, GossipError, TopologyError


@click.group()
@click.version_option(package_name="gossip")
def main():
    """gossip: decentralized deep learning over ZeroMQ."""


class DeclaredDefault(click.Option):
    """A flag whose default is the one its owner declares (``source``: ``module:Name``, a
    dataclass field or keyword parameter ``field`` of that class or function), so the CLI
    restates none. Read when the flag is parsed or its help shown, not at import: owners
    import torch or zmq, which `gossip --help` does without."""

    def __init__(self, *args, source: str, field: str, **kwargs):
        super().__init__(*args, show_default=True, **kwargs)
        self.source, self.field = source, field

    def get_default(self, ctx: click.Context, call: bool = True):
        return declared(self.source, self.field)


def declared(source: str, name: str):
    """The default that ``source`` (``module:Name``) declares for its parameter ``name``."""
    import importlib
    import inspect

    module, _, owner = source.partition(":")
    return inspect.signature(getattr(importlib.import_module(module), owner)) \
        .parameters[name].default


def declared_option(*decls: str, source: str, field: str, **kwargs):
    """``click.option`` whose default is ``source``'s declaration of ``field``
    (``DeclaredDefault``)."""
    return click.option(*decls, cls=DeclaredDefault, source=source, field=field, **kwargs)


def run_forked(args: list[str]) -> None:
    """A forked peer's entry point (``gossip.launching.forkserver``): what `python -m gossip
    ARGS` runs. The server imports it by name, so ``gossip.cli`` first: every command."""
    main(args=args, prog_name="gossip")


def fail_cleanly(fn):
    """GossipError -> one line on stderr and exit 1; Ctrl-C -> exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GossipError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def parse_size(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 1000, 1M or 25M") from None


def key_values(flag: str, given, items) -> dict:
    """``("a=1", "b=x")`` on top of ``given`` -> ``{"a": 1, "b": "x"}`` (values read as YAML)."""
    import yaml

    values = dict(given or {})
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
        values[key] = yaml.safe_load(value)
    return values


DEFAULT_PEERS = 4
GRAPH_OPTION = click.option(
    "--graph-option", "graph_options", multiple=True, metavar="KEY=VALUE",
    help="Parameter of the --graph generator, repeatable (e.g. rows=2 and cols=4 for a "
         "torus, p=0.3 for erdos_renyi).")


def generated_topology(kind: str, peers: int | None, graph_options):
    """The topology of ``--graph KIND --graph-option ...`` with ``--peers`` (default 4, or
    the size the parameters imply: a torus's rows x cols)."""
    from gossip.topology import Topology, generators

    params = key_values("--graph-option", None, graph_options)
    if peers is None and not generators.size_implied(kind):
        peers = DEFAULT_PEERS  # a torus takes its size from rows x cols, or --peers
    try:
        return Topology.generate(kind, peers, **params)
    except TopologyError as exc:
        raise TopologyError(f"--graph {exc} (--graph-option KEY=VALUE sets its "
                            f"parameters)") from None



CHURN_HELP = ("With --elastic: peers join, leave and are killed at rounds, e.g. "
              "join@10,leave:3@20,kill:5@30, or random:PCT%/N (PCT% of --peers change every N "
              "rounds, drawn with --seed); joiners run on spare ranks after --peers (a "
              "--topology's last ones); membership.jsonl records it.")


def run_topology(churn: str | None, config, topology_path: str | None, peers: int | None,
                 graph: str, graph_options):
    """The run's topology (``--topology``, else ``--graph`` of ``--peers``) with a spare
    rank for each join of ``churn`` (`gossip launch` and `gossip simulate`); returns it,
    ``config`` with its ``spares`` and the schedule's events (gossip.launching.churn)."""
    import dataclasses

    from gossip.launching import churn as churns
    from gossip.topology import Topology

    events = []
    if churn:
        if not config.elastic:
            raise ConfigError("--churn: only with --elastic (joins and leaves run on the "
                              "members' agreed views)")
        if topology_path and churn.startswith(churns.RANDOM):
            raise ConfigError("--churn random: only with --peers (a --topology's size would "
                              "have to hold the joins it draws)")
        if topology_path:  # its last ranks are the spares, one per join
            peers = Topology.from_yaml(topology_path).size - churns.joins_in(churn)
        else:
            peers = (peers or generated_topology(graph, None, graph_options).size)
        events = churns.parse(churns.expand(churn, peers, config.rounds, config.seed), peers)
        config = dataclasses.replace(config, spares=len(churns.joiners(events)))
    if topology_path:
        return Topology.from_yaml(topology_path), config, events
    return (generated_topology(graph, peers and peers + config.spares, graph_options), config,
            events)
