"""iproute2 for virtual clusters: running ``ip`` and ``tc``, the names of a cluster's
namespaces and links, what of them exists, deleting them, stopping what runs inside, and
whether this machine can host a cluster at all."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import cache

from gossip.cluster.rate import parse_rate
from gossip.errors import NetnsError, NetnsUnavailable

NS_IFACE = "eth0"
CMD_TIMEOUT_S = 20.0
STOP_GRACE_S = 2.0
IFNAME_MAX = 15  # IFNAMSIZ - 1
MAX_PREFIX = 6  # "gv-" + prefix + "-" + rank fits IFNAME_MAX up to rank 99999
PREFIX = re.compile(rf"^[a-z0-9]{{1,{MAX_PREFIX}}}$")
NS_NAME = re.compile(rf"^gossip-([a-z0-9]{{1,{MAX_PREFIX}}})-\d+$")
LINK_NAME = re.compile(rf"^g[bv]-([a-z0-9]{{1,{MAX_PREFIX}}})(-\d+)?$")


def ns_name(prefix: str, rank: int) -> str:
    return f"gossip-{prefix}-{rank}"


def bridge_name(prefix: str) -> str:
    return f"gb-{prefix}"


def veth_name(prefix: str, rank: int) -> str:
    return f"gv-{prefix}-{rank}"


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run an iproute2 command; NetnsError names the command and its last stderr line."""
    argv = list(argv)
    try:
        result = subprocess.run(argv, check=False, capture_output=True, text=True,
                                timeout=CMD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise NetnsUnavailable(f"`{argv[0]}` not found: a virtual cluster needs iproute2 "
                               "(ip, tc)") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{shlex.join(argv)}` did not finish in {CMD_TIMEOUT_S:g} s") from None
    if check and result.returncode:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise NetnsError(f"`{shlex.join(argv)}` failed (exit {result.returncode}): "
                         f"{lines[-1] if lines else 'no output'}")
    return result


# -- what exists --------------------------------------------------------------------------


def listing() -> tuple[list[str], list[str]]:
    """Names of every namespace and every root-namespace link."""
    namespaces = [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines()
                  if line.strip()]
    links = [link["ifname"] for link in json.loads(run(["ip", "-j", "link", "show"]).stdout)]
    return namespaces, links


def prefixes_in_use() -> set[str]:
    namespaces, links = listing()
    found = {m.group(1) for name in namespaces if (m := NS_NAME.match(name))}
    return found | {m.group(1) for name in links if (m := LINK_NAME.match(name))}


def free_prefix() -> str:
    used = prefixes_in_use()
    while (prefix := secrets.token_hex(3)[:5]) in used:
        pass
    return prefix


def tbf_bytes(text: str) -> int:
    """The bytes the tbf qdiscs in ``tc -s -j qdisc show`` output let through."""
    qdiscs = json.loads(text or "[]")
    return sum(q.get("bytes", 0) for q in qdiscs if q.get("kind") == "tbf")


# -- deleting and stopping ----------------------------------------------------------------


def delete(kind: str, name: str) -> None:
    """Delete a namespace or link; one that is already gone is fine."""
    argv = ["ip", "netns", "del", name] if kind == "ns" else ["ip", "link", "del", name]
    result = run(argv, check=False)
    gone = ("No such file", "Cannot find device", "does not exist")
    if result.returncode and not any(text in result.stderr for text in gone):
        raise NetnsError(f"`{shlex.join(argv)}` failed (exit {result.returncode}): "
                         f"{result.stderr.strip() or 'no output'}")


def namespace_pids(namespaces: Sequence[str]) -> list[int]:
    pids = []
    for ns in namespaces:
        result = run(["ip", "netns", "pids", ns], check=False)
        if result.returncode == 0:
            pids += [int(pid) for pid in result.stdout.split()]
    return pids


def kill_in_namespaces(namespaces: Sequence[str]) -> None:
    """SIGTERM every process in ``namespaces``, SIGKILL what is left after a grace period.

    A process keeps its namespace (and its veth) alive after ``ip netns del``, so nothing may
    be left running when the names go.
    """
    start = time.monotonic()
    while pids := namespace_pids(namespaces):
        waited = time.monotonic() - start
        if waited > 2 * STOP_GRACE_S:  # unkillable (stuck in the kernel): give up on it
            print(f"warning: processes {pids} in {', '.join(namespaces)} survive SIGKILL",
                  file=sys.stderr)
            return
        sig = signal.SIGTERM if waited < STOP_GRACE_S else signal.SIGKILL
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


# -- availability -------------------------------------------------------------------------


def check_available() -> None:
    """Raise NetnsUnavailable saying what is missing: root, ``ip``/``tc``, netns or tbf."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("a virtual cluster needs root (network namespaces, veth, tc); "
                               "run as root or with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"`{tool}` not found: a virtual cluster needs iproute2")
    _probe()


@cache
def _probe() -> None:
    """Build a throwaway namespace with a bridge, a veth pair and a tbf qdisc inside it.

    The root namespace is never touched; success is cached for the process.
    """
    probe = ns_name(free_prefix(), 0)
    try:
        run(["ip", "netns", "add", probe])
        try:
            run(["ip", "-n", probe, "link", "add", "gp-br", "type", "bridge"])
            run(["ip", "-n", probe, "link", "add", "gp-a", "type", "veth", "peer", "name", "gp-b"])
            run(["tc", "-n", probe, "qdisc", "add", "dev", "gp-a", "root",
                 *parse_rate("1mbit").tbf_args()])
        finally:
            run(["ip", "netns", "del", probe], check=False)
    except NetnsUnavailable:
        raise
    except NetnsError as exc:
        raise NetnsUnavailable(f"network namespaces with veth, bridge and tbf are not usable "
                               f"here: {exc}") from None


def unavailable_reason() -> str | None:
    """Why no virtual cluster can be built here (one line), or None when one can."""
    try:
        check_available()
    except NetnsUnavailable as exc:
        return str(exc)
    return None
