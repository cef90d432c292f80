"""Making sure a virtual cluster goes away: the clusters open in this process, SIGTERM and
SIGHUP unwinding like an exception, signals held during teardown, a last close at
interpreter exit, and removal of what a crashed run left behind."""

from __future__ import annotations

import atexit
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gossip.cluster.iproute import (
    LINK_NAME,
    MAX_PREFIX,
    NS_NAME,
    PREFIX,
    check_available,
    delete,
    kill_in_namespaces,
    listing,
)
from gossip.errors import ConfigError, GossipError

_TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_OPEN: list = []  # the VirtualClusters open in this process
_LOCK = threading.Lock()
_SAVED_HANDLERS: dict[int, object] = {}


def _exit_on_signal(signum: int, _frame) -> None:
    # Unwinds like an exception, so every `with VirtualCluster` on the stack tears down.
    raise SystemExit(128 + signum)


def register(cluster) -> None:
    """``cluster`` (anything with ``prefix`` and ``close()``) is open: closed at the latest
    at exit, and SIGTERM/SIGHUP unwind until none is open."""
    with _LOCK:
        if not _OPEN and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                # Only where the default would kill us without unwinding; never steal a handler.
                if signal.getsignal(sig) == signal.SIG_DFL:
                    _SAVED_HANDLERS[sig] = signal.signal(sig, _exit_on_signal)
        _OPEN.append(cluster)


def unregister(cluster) -> None:
    """``cluster`` is closed."""
    with _LOCK:
        if cluster in _OPEN:
            _OPEN.remove(cluster)
        if not _OPEN and threading.current_thread() is threading.main_thread():
            for sig, previous in list(_SAVED_HANDLERS.items()):
                if signal.getsignal(sig) is _exit_on_signal:
                    signal.signal(sig, previous)
                del _SAVED_HANDLERS[sig]


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C/SIGTERM/SIGHUP until teardown is done (they arrive right after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _TEARDOWN_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@atexit.register
def _close_all() -> None:
    for cluster in reversed(list(_OPEN)):
        try:
            cluster.close()
        except GossipError as exc:
            print(f"warning: {exc}", file=sys.stderr)


def cleanup_stale(prefix: str | None = None) -> list[str]:
    """Remove namespaces, veths and bridges a crashed run left behind; return their names.

    With ``prefix`` only that cluster's; with None every ``gossip-*`` cluster not open in this
    process (so not while another process runs one). Processes inside are killed first.
    """
    if prefix is not None and not PREFIX.match(prefix):
        raise ConfigError(f"prefix {prefix!r}: expected 1-{MAX_PREFIX} of [a-z0-9]")
    check_available()
    live = {cluster.prefix for cluster in list(_OPEN)}

    def stale(match: re.Match | None) -> bool:
        return bool(match) and (match.group(1) == prefix if prefix else match.group(1) not in live)

    namespaces, links = listing()
    namespaces = [name for name in namespaces if stale(NS_NAME.match(name))]
    links = [name for name in links if stale(LINK_NAME.match(name))]
    with signals_deferred():
        kill_in_namespaces(namespaces)
        # veths before their bridge; namespaces after the veth pairs that point into them.
        order = sorted(links, key=lambda name: name.startswith("gb-"))
        for kind, name in [("link", name) for name in order] + [("ns", n) for n in namespaces]:
            delete(kind, name)
    return order + namespaces
