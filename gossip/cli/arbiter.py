"""`gossip arbiter`: the device arbiter of one machine, for jobs that share its devices."""

from __future__ import annotations

import logging
import signal
import threading

import click

from gossip.cli.common import declared_option, fail_cleanly, main
from gossip.errors import ConfigError

SERVER = "gossip.crossover.server:ArbiterServer"  # declares the defaults


@main.command()
@click.option("--bind", "address", required=True, metavar="ADDRESS",
              help="Where peers reach it: ipc://PATH (every network namespace of this "
                   "machine) or tcp://HOST:PORT.")
@declared_option("--patience", source=SERVER, field="patience_s", type=float,
                 metavar="SECONDS", help="How long a free device waits for the job whose "
                 "turn it is (inf: strict alternation, 0: first come first served).")
@declared_option("--max-hold", source=SERVER, field="max_hold_s", type=float,
                 metavar="SECONDS", help="Revoke a grant held longer while another job waits; "
                 "the holder waits for the device again before more device time.")
@declared_option("--dead-after", source=SERVER, field="dead_after", type=float,
                 metavar="SECONDS",
                 help="Drop a client silent this long while the device waits for it.")
@click.option("--log", "grant_log", type=click.Path(dir_okay=False),
              help="Append one JSON line per grant here.")
@fail_cleanly
def arbiter(address, patience, max_hold, dead_after, grant_log):
    """Grant each device's compute phase to the jobs sharing it, in turns, until stopped
    (SIGTERM or Ctrl-C)."""
    import zmq

    from gossip.crossover.server import ArbiterServer

    from gossip.crossover.address import check_address

    check_address(address, what="--bind", bind=True)
    if not patience >= 0:
        raise ConfigError(f"--patience {patience}: must be >= 0")
    for name, value in (("--max-hold", max_hold), ("--dead-after", dead_after)):
        if not value > 0:
            raise ConfigError(f"{name} {value}: must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        server = ArbiterServer(address, patience_s=patience, max_hold_s=max_hold,
                               dead_after=dead_after, grant_log=grant_log)
    except zmq.ZMQError as exc:
        raise ConfigError(f"--bind {address}: {exc}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    click.echo(f"arbiter on {server.address}", err=True)
    try:
        server.serve(stop)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
