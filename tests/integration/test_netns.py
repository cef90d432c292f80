"""The netns virtual cluster: namespaces with their own IPs behind tbf-capped links.

Tests that build namespaces need root and iproute2; they skip, naming what is missing, only
where a throwaway namespace cannot be created. Every test checks it left nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from gossip.cluster import (
    NetnsError,
    NetnsUnavailable,
    VirtualCluster,
    check_available,
    cleanup_stale,
    measure_throughput,
    parse_rate,
    unavailable_reason,
)
from gossip.cluster import iproute
from gossip.cluster import netns as netns_module
from gossip.errors import ConfigError
from gossip.launching import processes as launcher
from gossip.metrics import read_jsonl
from gossip.transport.endpoints import local_ipc

PROC_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def netns() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"netns virtual cluster unavailable: {reason}")


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links of cluster ``prefix`` that still exist."""
    namespaces, links = iproute.listing()
    return [name for name in namespaces + links
            if name.startswith((f"gossip-{prefix}-", f"gv-{prefix}-")) or name == f"gb-{prefix}"]


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


# -- without root ---------------------------------------------------------------------


@pytest.mark.parametrize("text, bits", [("100mbit", 10**8), ("1gbit", 10**9),
                                        ("500kbit", 5 * 10**5), ("1.5Mbit", 15 * 10**5),
                                        ("10mbps", 8 * 10**7), (2_000_000, 2 * 10**6)])
def test_rates_parse_as_tc_reads_them(text, bits):
    assert parse_rate(text).bits == bits


@pytest.mark.parametrize("rate", ["fast", "100", "100mb", "0mbit", "-1mbit", "1kbit", "", None])
def test_bad_rate_is_a_config_error_before_anything_is_created(rate):
    with pytest.raises(ConfigError, match="rate"):
        VirtualCluster(2, rate=rate)


@pytest.mark.parametrize("kwargs, culprit", [
    ({"size": 0}, "size"), ({"size": 300}, "too small for 300 peers"),
    ({"size": 2, "subnet": "10.77.0.0/33"}, "subnet"), ({"size": 2, "prefix": "Bad-1"}, "prefix"),
    ({"size": 2, "prefix": "toolong7"}, "prefix")])
def test_bad_arguments_name_the_argument(kwargs, culprit):
    with pytest.raises(ConfigError, match=culprit):
        VirtualCluster(**kwargs)


def test_missing_root_or_iproute2_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(iproute.os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="needs root"):
        check_available()
    monkeypatch.setattr(iproute.os, "geteuid", lambda: 0)
    monkeypatch.setattr(iproute.shutil, "which", lambda tool: None if tool == "tc" else tool)
    with pytest.raises(NetnsUnavailable, match="`tc` not found: .* needs iproute2"):
        check_available()


# -- with root --------------------------------------------------------------------------


def test_setup_gives_each_rank_its_ip_and_teardown_leaves_nothing(netns):
    with pytest.raises(RuntimeError, match="body failed"), \
            VirtualCluster(3, rate="100mbit") as cluster:
        prefix = cluster.prefix
        assert sorted(leftovers(prefix)) == sorted(
            [*cluster.namespaces, *(f"gv-{prefix}-{r}" for r in range(3)), cluster.bridge])
        for rank in range(3):
            assert cluster.host(rank) == f"10.77.0.{rank + 1}"
            addr = iproute.run(["ip", "-n", cluster.namespace(rank), "-4", "-o", "addr",
                                "show", "dev", "eth0"]).stdout
            assert f"inet {cluster.host(rank)}/24" in addr
            for where in (["-n", cluster.namespace(rank), "qdisc", "show", "dev", "eth0"],
                          ["qdisc", "show", "dev", f"gv-{prefix}-{rank}"]):
                (qdisc,) = json.loads(iproute.run(["tc", "-j", *where, "root"]).stdout)
                assert qdisc["kind"] == "tbf" and qdisc["options"]["rate"] == 100e6 / 8
        raise RuntimeError("body failed")
    assert leftovers(prefix) == []


@pytest.mark.parametrize("fail", [NetnsError("injected"), KeyboardInterrupt()])
def test_failure_half_way_removes_what_was_created(netns, monkeypatch, fail):
    real_run = iproute.run
    seen: list[list[str]] = []

    def flaky(argv, **kwargs):
        seen.append(list(argv))
        if argv[:2] == ["tc", "qdisc"] and argv[4].endswith("-1"):  # rank 1's downlink cap
            raise fail
        return real_run(argv, **kwargs)

    monkeypatch.setattr(netns_module, "run", flaky)
    cluster = VirtualCluster(3, rate="1gbit")
    with pytest.raises(type(fail)):
        cluster.open()
    assert any(argv[:3] == ["ip", "netns", "add"] for argv in seen)
    assert leftovers(cluster.prefix) == []


def test_setup_errors_name_the_command_and_never_delete_foreign_names(netns, monkeypatch):
    cluster = VirtualCluster(2)
    cluster.prefix = iproute.free_prefix()
    foreign = iproute.ns_name(cluster.prefix, 1)
    iproute.run(["ip", "netns", "add", foreign])
    try:
        # A name in use is refused up front...
        with pytest.raises(NetnsError, match=f"prefix '{cluster.prefix}' is in use"):
            cluster.open()
        # ...and a collision during setup names the failed command.
        monkeypatch.setattr(netns_module, "prefixes_in_use", lambda: set())
        with pytest.raises(NetnsError, match=f"`ip netns add {foreign}` failed .*exists"):
            cluster.open()
        assert leftovers(cluster.prefix) == [foreign]
    finally:
        iproute.run(["ip", "netns", "del", foreign], check=False)


def test_sigterm_tears_down_and_cleanup_stale_removes_a_killed_run(netns):
    opener = """
        import os, sys, time
        from gossip.cluster import VirtualCluster
        cluster = VirtualCluster(2).open()
        cluster.popen(1, ["sleep", "60"])
        print(cluster.prefix, flush=True)
        if sys.argv[1] == "crash":
            os._exit(0)  # no teardown at all, like SIGKILL
        time.sleep(60)  # until the test SIGTERMs it
    """
    for mode in ("term", "crash"):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(opener), mode], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        prefix = None
        try:
            prefix = proc.stdout.readline().strip()
            assert prefix, proc.communicate(timeout=PROC_TIMEOUT_S)[1]
            if mode == "term":
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=PROC_TIMEOUT_S) == 128 + signal.SIGTERM
                assert leftovers(prefix) == []
            else:
                assert proc.wait(timeout=PROC_TIMEOUT_S) == 0
                stale = leftovers(prefix)
                assert len(stale) == 5 and iproute.namespace_pids(stale)  # sleep still inside
                assert sorted(cleanup_stale(prefix)) == sorted(stale)
                assert leftovers(prefix) == []
        finally:
            kill(proc)
            if prefix:
                cleanup_stale(prefix)


def test_tbf_caps_uplink_and_downlink(netns):
    with VirtualCluster(3, rate="100mbit") as cluster:
        alone = measure_throughput(cluster, 0, 1, 5_000_000)
        assert 0.6 <= alone.bits_per_s / cluster.rate.bits <= 1.1, alone
        # Two senders into rank 2 share its downlink (each uplink alone would allow the cap).
        shared: dict[int, object] = {}

        def send(src: int) -> None:
            shared[src] = measure_throughput(cluster, src, 2, 5_000_000, port=5300 + src)

        threads = [threading.Thread(target=send, args=(src,)) for src in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(PROC_TIMEOUT_S)
        assert set(shared) == {0, 1}, shared
        for src, result in shared.items():
            assert result.bits_per_s / cluster.rate.bits < 0.8, (src, str(result))
        assert cluster.link_bytes(2)["received"] >= 10_000_000
    assert leftovers(cluster.prefix) == []


@pytest.mark.slow
def test_peers_in_namespaces_train_over_capped_tcp(netns, tmp_path):
    with VirtualCluster(3, rate="1gbit") as cluster:
        topology = cluster.topology("ring")
        assert len({peer.host for peer in topology.peers}) == 3
        # Not loopback hosts: ZmqTransport takes TCP, so every byte crosses the tbf links.
        assert all(local_ipc(topology.address(rank)) is None for rank in range(3))
        topology.to_yaml(tmp_path / "topology.yaml")
        procs = launcher.start_peers([0, 1, 2], tmp_path, [
            "--topology", str(tmp_path / "topology.yaml"), "--strategy", "dpsgd",
            "--rounds", "3", "--timeout", "20"], wrap=cluster.command)
        deadline = time.monotonic() + PROC_TIMEOUT_S

        def on_progress(_done: int) -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"peers still running after {PROC_TIMEOUT_S} s")

        try:
            launcher.watch(procs, on_progress)
        finally:
            launcher.stop(procs)
        for rank in range(3):
            last = read_jsonl(tmp_path / f"peer-{rank}.jsonl")[-1]
            assert last["round"] == 2 and last["bytes_sent"] > 0
            assert cluster.link_bytes(rank)["sent"] > last["bytes_sent"]
    assert leftovers(cluster.prefix) == []


@pytest.mark.slow
def test_gossip_launch_netns(netns, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossip", "launch", "--netns", "--rate", "100mbit", "--peers", "3",
         "--rounds", "3", "--run-dir", "run"], cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out = err = ""
    try:
        out, err = proc.communicate(timeout=PROC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # lets the launcher tear its cluster down
        out, err = proc.communicate(timeout=10)
    finally:
        kill(proc)
        header = next((line for line in out.splitlines() if line.startswith("netns cluster ")),
                      "")
        prefix = header.split()[2].rstrip(":") if header else None
        if prefix:
            cleanup_stale(prefix)
    assert proc.returncode == 0, err
    assert prefix and "100mbit per link each way" in header, out
    assert leftovers(prefix) == []
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert [p["host"] for p in config["topology"]["peers"]] == ["10.77.0.1", "10.77.0.2",
                                                                "10.77.0.3"]
    assert config["netns"] == {"rate": "100mbit"}
    assert "mean test accuracy" in out
