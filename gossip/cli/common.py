"""The `gossip` command group and what every command shares: clean one-line errors, sizes."""

from __future__ import annotations

import functools
import sys

import click

from gossip.errors import GossipError


@click.group()
@click.version_option(package_name="gossip")
def main():
    """gossip: decentralized deep learning over ZeroMQ."""


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
