"""VirtualCluster: P Linux network namespaces on one bridge, every link capped with tbf.

Rank ``r`` lives in namespace ``gossip-<prefix>-r`` with its own address on ``eth0``. The
other end of its veth pair, ``gv-<prefix>-r``, is a port of bridge ``gb-<prefix>``::

    [ns r: eth0 10.77.0.(r+1)] --tbf--> gv-<prefix>-r
        --bridge gb-<prefix>-- gv-<prefix>-s --tbf--> [ns s: eth0 10.77.0.(s+1)]

tbf on ``eth0`` caps what the peer sends; tbf on ``gv-..`` (its egress is the peer's ingress)
caps what it receives. The root namespace has no address on the bridge, so two clusters with
the same subnet never collide and no traffic leaves the cluster.

Needs root and iproute2 (``ip``, ``tc``; iproute.py runs them); everything created is
removed on exit, on an exception, on SIGTERM/SIGHUP/Ctrl-C and, as a last resort, at
interpreter exit (teardown.py).
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Sequence

from gossip.cluster.iproute import (
    IFNAME_MAX,
    MAX_PREFIX,
    NS_IFACE,
    PREFIX,
    STOP_GRACE_S,
    NetnsError,
    bridge_name,
    check_available,
    delete,
    free_prefix,
    kill_in_namespaces,
    ns_name,
    prefixes_in_use,
    run,
    tbf_bytes,
    veth_name,
)
from gossip.cluster.rate import DEFAULT_RATE, Rate, parse_rate
from gossip.cluster.teardown import register, signals_deferred, unregister
from gossip.errors import ConfigError


class VirtualCluster:
    """P network namespaces on one bridge, each peer's link capped at ``rate`` both ways.

    Use it as a context manager (or ``open()``/``close()``)::

        with VirtualCluster(4, rate="100mbit") as cluster:
            topology = cluster.topology("ring")            # peers at 10.77.0.1..4
            procs = [cluster.popen(r, ["python", "-m", "gossip", "peer", ...]) for r in ...]

    Args:
        size: Number of namespaces P (ranks ``0..P-1``).
        rate: Per-direction cap of every link, e.g. ``"100mbit"``, ``"1gbit"``, ``"500kbit"``.
        subnet: IPv4 network; rank ``r`` gets its ``r+1``-th address.
        prefix: Up to 6 of ``[a-z0-9]`` naming this cluster's namespaces and interfaces;
            default a fresh random one.
        burst: tbf bucket in bytes (default: 2 ms of traffic, at least 16 KiB).
        latency_ms: Longest a packet may wait in tbf's queue (default 50 ms).

    Raises:
        ConfigError: Bad size, rate, subnet or prefix.
        NetnsUnavailable: Not root, no iproute2, or namespaces not permitted.
        NetnsError: A setup command failed (named); what was created is removed first.
    """

    def __init__(self, size: int, *, rate: str | int | Rate = DEFAULT_RATE,
                 subnet: str = "10.77.0.0/24", prefix: str | None = None,
                 burst: int | None = None, latency_ms: float | None = None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"size: expected a positive number of peers, got {size!r}")
        self.size = size
        self.rate = parse_rate(rate)
        try:
            self.subnet = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise ConfigError(f"subnet {subnet!r}: {exc} (expected e.g. 10.77.0.0/24)") from None
        if size > self.subnet.num_addresses - 2:
            raise ConfigError(f"subnet {subnet}: too small for {size} peers")
        if prefix is not None and not PREFIX.match(prefix):
            raise ConfigError(f"prefix {prefix!r}: expected 1-{MAX_PREFIX} of [a-z0-9]")
        if burst is not None and burst < 2048:
            raise ConfigError(f"burst: {burst} bytes cannot hold a full-size frame (>= 2048)")
        if latency_ms is not None and not latency_ms > 0:
            raise ConfigError(f"latency_ms: expected a positive number, got {latency_ms!r}")
        self.prefix = prefix
        self._tbf = self.rate.tbf_args(burst=burst, latency_ms=latency_ms)
        # Everything this instance created, in order, so teardown deletes exactly that.
        self._created: list[tuple[str, str]] = []
        self._procs: list[subprocess.Popen] = []
        self._opened = False

    # -- names and addresses ---------------------------------------------------------

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ConfigError(f"rank {rank!r} is not in the cluster (0..{self.size - 1})")
        return rank

    def host(self, rank: int) -> str:
        """IP address of ``rank`` (inside its namespace)."""
        return str(self.subnet.network_address + self._rank(rank) + 1)

    def namespace(self, rank: int) -> str:
        return ns_name(self._need_prefix(), self._rank(rank))

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(rank) for rank in range(self.size)]

    @property
    def bridge(self) -> str:
        return bridge_name(self._need_prefix())

    def _need_prefix(self) -> str:
        if self.prefix is None:
            raise NetnsError("the cluster has no names yet: open() it first")
        return self.prefix

    def describe(self) -> str:
        """One line: names, addresses and rate."""
        last = self.size - 1
        return (f"netns cluster {self.prefix}: {self.size} namespaces "
                f"gossip-{self.prefix}-{{0..{last}}} at {self.host(0)}..{self.host(last)} on "
                f"bridge {self.bridge}, {self.rate} per link each way")

    def __repr__(self) -> str:
        return f"VirtualCluster(size={self.size}, rate={str(self.rate)!r}, prefix={self.prefix!r})"

    # -- topology ----------------------------------------------------------------------

    def relocate(self, topology, *, port: int | None = None):
        """``topology`` with rank ``r`` at ``host(r)``; ports kept, or all set to ``port``
        (every namespace has its own port space)."""
        from gossip.topology import PeerAddress, Topology

        if topology.size != self.size:
            raise ConfigError(f"topology has {topology.size} peers but the cluster {self.size}")
        peers = [PeerAddress(p.rank, self.host(p.rank), p.port if port is None else port)
                 for p in topology.peers]
        return Topology(topology.graph, peers, name=topology.name)

    def topology(self, kind: str = "ring", *, port: int = 7000, **params):
        """A generated graph (see ``Topology.generate``) on this cluster's addresses."""
        from gossip.topology import Topology

        return self.relocate(Topology.generate(kind, self.size, **params), port=port)

    # -- processes ---------------------------------------------------------------------

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``rank``'s namespace: ``ip netns exec NAME argv...``."""
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def popen(self, rank: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``rank``'s namespace (own session); stopped at close() if alive."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(rank, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def link_bytes(self, rank: int) -> dict[str, int]:
        """Bytes tbf let through so far: ``sent`` by ``rank`` (uplink) and ``received``."""
        ns, veth = self.namespace(rank), veth_name(self._need_prefix(), self._rank(rank))
        up = run(["tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", NS_IFACE, "root"])
        down = run(["tc", "-s", "-j", "qdisc", "show", "dev", veth, "root"])
        return {"sent": tbf_bytes(up.stdout), "received": tbf_bytes(down.stdout)}

    # -- life cycle --------------------------------------------------------------------

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc_info) -> None:
        # A teardown failure must not hide the exception that ended the body.
        try:
            self.close()
        except NetnsError as exc:
            if exc_info[0] is None:
                raise
            print(f"warning: {exc}", file=sys.stderr)

    def open(self) -> VirtualCluster:
        """Create bridge, namespaces, veths and qdiscs; on any failure remove them again."""
        if self._opened:
            raise NetnsError(f"{self!r} is already open")
        check_available()
        if self.prefix is None:
            self.prefix = free_prefix()
        elif self.prefix in prefixes_in_use():
            raise NetnsError(f"prefix {self.prefix!r} is in use; pick another or run "
                             f"`tools/netns-cluster cleanup --prefix {self.prefix}`")
        if len(veth_name(self.prefix, self.size - 1)) > IFNAME_MAX:
            raise ConfigError(f"prefix {self.prefix!r}: too long for {self.size} peers "
                              f"(interface names have at most {IFNAME_MAX} characters)")
        self._opened = True
        register(self)
        try:
            self._create()
        except BaseException:
            self.close(quiet=True)
            raise
        return self

    def _create(self) -> None:
        bridge, plen = self.bridge, self.subnet.prefixlen
        # Every interface gets `addrgenmode none` before it goes up (a separate command: in
        # one, "up" comes first): no IPv6 link-local address, hence no DAD, router or MLD
        # chatter, so the tbf counters count the peers' traffic only.
        self._add("link", bridge, ["ip", "link", "add", bridge, "type", "bridge"])
        run(["ip", "link", "set", bridge, "addrgenmode", "none"])
        run(["ip", "link", "set", bridge, "up"])
        for rank in range(self.size):
            ns, veth = self.namespace(rank), veth_name(self.prefix, rank)
            self._add("ns", ns, ["ip", "netns", "add", ns])
            # The peer end is born inside the namespace: no name clash in the root namespace.
            self._add("link", veth, ["ip", "link", "add", veth, "type", "veth",
                                     "peer", "name", NS_IFACE, "netns", ns])
            run(["ip", "link", "set", veth, "master", bridge, "addrgenmode", "none"])
            run(["ip", "link", "set", veth, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.host(rank)}/{plen}", "dev", NS_IFACE])
            run(["ip", "-n", ns, "link", "set", NS_IFACE, "addrgenmode", "none"])
            run(["ip", "-n", ns, "link", "set", NS_IFACE, "up"])
            run(["tc", "-n", ns, "qdisc", "add", "dev", NS_IFACE, "root", *self._tbf])
            run(["tc", "qdisc", "add", "dev", veth, "root", *self._tbf])

    def _add(self, kind: str, name: str, argv: list[str]) -> None:
        # Recorded before running, so an interrupt mid-command still tears it down; dropped
        # again when the command fails, so a name that already existed is never deleted.
        self._created.append((kind, name))
        try:
            run(argv)
        except NetnsError:
            self._created.pop()
            raise

    def close(self, *, quiet: bool = False) -> None:
        """Stop processes left in the namespaces and delete everything created. Idempotent.

        Every step is tried; failures are reported together afterwards (unless ``quiet``).
        """
        errors: list[str] = []
        with signals_deferred():
            self._stop_processes()
            for kind, name in reversed(self._created):
                try:
                    delete(kind, name)
                except NetnsError as exc:
                    errors.append(str(exc))
            self._created.clear()
            self._opened = False
            unregister(self)
        if errors and not quiet:
            raise NetnsError(f"teardown of cluster {self.prefix} incomplete: "
                             f"{'; '.join(errors)} (retry: tools/netns-cluster cleanup "
                             f"--prefix {self.prefix})")

    def _stop_processes(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        kill_in_namespaces([name for kind, name in self._created if kind == "ns"])
        for proc in self._procs:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
