"""`gossip strategies` and `gossip compressors`: what each strategy and compressor takes."""

from __future__ import annotations

import click

from gossip.cli.common import fail_cleanly, main

_SAYS = {"exact_mean": "returns the exact mean", "preserves_mean": "keeps the peers' average",
         "needs_every_peer": "needs every peer each round",
         "can_rejoin": "a restarted peer can rejoin", "checks_own_result": None,
         "stops_rounds_early": "ends rounds at run time (no overlap)",
         "plans_rounds": "plans each round (local steps, averages; no overlap)",
         "serves_roles": "runs the topology's server roles"}


@main.command("strategies")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list instead.")
@click.option("--matrix", is_flag=True,
              help="Print the compatibility matrix instead: every strategy (and wrapper with "
                   "each inner) against every mode, works or why it is refused (the "
                   "docs/MATRIX.md table).")
@fail_cleanly
def strategies(as_json, matrix):
    """Every registered strategy: what it does, its capabilities and its options (defaults
    and docs). Set options with --option KEY=VALUE, YAML `options:` or Peer(**options)."""
    if matrix:
        from gossip.matrix import markdown

        click.echo(markdown(), nl=False)
        return
    from gossip.strategies import STRATEGIES

    _print(STRATEGIES.describe(), as_json, capabilities=True)


@main.command("compressors")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list instead.")
@fail_cleanly
def compressors(as_json):
    """Every compressor and its options, then the wrappers' options (error feedback,
    momentum, clipping, warm-up); give them as strategy options with compressor=NAME.
    Low-rank compression (PowerSGD) is the strategy powersgd."""
    from gossip.compress.catalog import describe

    _print(describe(), as_json)


def _print(entries: list[dict], as_json: bool, *, capabilities: bool = False) -> None:
    import json

    from gossip.bench.harness import format_table

    if as_json:
        click.echo(json.dumps(entries, indent=1, default=repr))
        return
    for entry in entries:
        click.echo(f"{entry['name']}: {entry['doc']}")
        if capabilities:
            held = entry["capabilities"]
            says = [f"operates on {held['operates_on']}"] + [
                text for key, text in _SAYS.items() if text and held.get(key)]
            says.append("lockstep rounds" if held["synchronous"] else "asynchronous")
            click.echo("  " + "; ".join(says))
        rows = [{"option": o["option"], "default": repr(o["default"]), "doc": o["doc"]}
                for o in entry["options"]]
        if rows:
            table = format_table(rows, ["option", "default", "doc"])
            click.echo("\n".join("  " + line for line in table.splitlines()))
        click.echo("")
