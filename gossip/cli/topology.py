"""`gossip topology show` and `gossip keys generate`: inspect a cluster's layout, key it."""

from __future__ import annotations

import click

from gossip.cli.common import fail_cleanly, main
from gossip.errors import ConfigError


@main.group()
def topology():
    """Inspect topology files."""


@topology.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--budget", metavar="C_B",
              help="Also plan MATCHA at this communication budget in (0, 1]: matchings, "
                   "activation probabilities, alpha and rho.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
@fail_cleanly
def topology_show(path, budget, as_json):
    """Peers, degrees, edges, Metropolis-Hastings mixing matrix and spectral gap; with
    --budget, MATCHA's matchings, probabilities, alpha and rho too."""
    import json

    from gossip.topology import Topology

    topo = Topology.from_yaml(path)
    plan = None
    if budget is not None:
        from gossip.topology import matcha

        try:  # parsed here, not by click, so a bad value is one line and exit 1
            value = float(budget)
        except ValueError:
            raise ConfigError(f"--budget: {budget!r} is not a number in (0, 1]") from None
        plan = matcha.plan(topo, value)
    if as_json:
        data = {"name": topo.name, "size": topo.size,
                "edges": [[a, b] for a, b in topo.edges()],
                "spectral_gap": topo.spectral_gap()}
        click.echo(json.dumps({**data, **(plan.to_dict() if plan else {})}))
    else:
        click.echo(topo.describe() + ("\n" + plan.describe() if plan else ""))


@main.group()
def keys():
    """CURVE keys that authenticate and encrypt peers."""


@keys.command("generate")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write peer-R.key (secret, mode 0600) and peer-R.key.pub.")
@click.option("--peers", type=int, help="One keypair per rank 0..PEERS-1.")
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False),
              help="One keypair per rank of this topology file (instead of --peers).")
@click.option("--force", is_flag=True, help="Replace existing key files.")
@fail_cleanly
def keys_generate(out_dir, peers, topology_path, force):
    """Write a fresh keypair per peer; name the directory in the topology (keys: DIR)."""
    from gossip import keys as curve_keys

    if (peers is None) == (topology_path is None):
        raise ConfigError("keys generate: give exactly one of --peers N or --topology FILE")
    if topology_path:
        from gossip.topology import Topology

        peers = Topology.from_yaml(topology_path).size
    if peers < 1:
        raise ConfigError(f"--peers: expected a positive number, got {peers}")
    written = curve_keys.generate(out_dir, range(peers), force=force)
    click.echo(f"{len(written) // 2} keypairs in {out_dir}: copy peer-R.key to rank R's machine "
               f"only; the *.pub files may go everywhere. Name them in the topology with "
               f"`keys: {out_dir}` (or each peer's public_key).")
