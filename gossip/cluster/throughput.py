"""An iperf-like check of a link cap: time a plain TCP transfer between two namespaces."""

from __future__ import annotations

import select
import subprocess
import sys
from dataclasses import dataclass

from gossip.errors import GossipError

PORT = 5201  # iperf's; every namespace has its own port space
_STARTUP_S = 10.0

# Receiver: accept one connection, read n bytes, print how many and how long from accept.
_RECEIVER = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((host, port))
print("ready", flush=True)
conn, _ = server.accept()
start, got, buf = time.perf_counter(), 0, bytearray(1 << 20)
while got < n:
    k = conn.recv_into(buf)
    if not k:
        break
    got += k
print(got, time.perf_counter() - start, flush=True)
"""
_SENDER = """
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = memoryview(bytes(1 << 20))
with socket.create_connection((host, port), timeout=30) as sock:
    while n > 0:
        sock.sendall(chunk[:min(n, len(chunk))])
        n -= len(chunk)
"""


@dataclass(frozen=True)
class Throughput:
    nbytes: int
    seconds: float

    @property
    def bits_per_s(self) -> float:
        return 8 * self.nbytes / self.seconds

    def __str__(self) -> str:
        return (f"{self.nbytes / 1e6:g} MB in {self.seconds:.3f} s = "
                f"{self.bits_per_s / 1e6:.1f} Mbit/s")


def measure_throughput(cluster, a: int, b: int, nbytes: int, *, port: int = PORT,
                       timeout: float = 60.0) -> Throughput:
    """Send ``nbytes`` over TCP from rank ``a`` to rank ``b`` of an open VirtualCluster.

    The clock runs at the receiver from ``accept`` to the last byte, so it covers TCP slow
    start but not the start of the two Python processes.

    Raises:
        GossipError: A side failed or the transfer took longer than ``timeout``.
    """
    args = [cluster.host(b), str(port), str(nbytes)]
    receiver = cluster.popen(b, [sys.executable, "-c", _RECEIVER, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sender = None
    try:
        ready, _, _ = select.select([receiver.stdout], [], [], _STARTUP_S)
        if not ready or receiver.stdout.readline().strip() != "ready":
            raise GossipError(f"throughput receiver in {cluster.namespace(b)} did not start: "
                              f"{_tail(receiver)}")
        sender = cluster.popen(a, [sys.executable, "-c", _SENDER, *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            out, err = receiver.communicate(timeout=timeout)
            sender.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise GossipError(f"{nbytes} bytes from rank {a} to rank {b} took over "
                              f"{timeout:g} s") from None
        if receiver.returncode or sender.returncode:
            raise GossipError(f"throughput test {a}->{b} failed: receiver "
                              f"{receiver.returncode} {err.strip()!r}, sender "
                              f"{sender.returncode} {sender.stderr.read().strip()!r}")
        got, seconds = out.split()
        if int(got) != nbytes:
            raise GossipError(f"throughput test {a}->{b}: received {got} of {nbytes} bytes")
        return Throughput(nbytes, float(seconds))
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _tail(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return "no answer"
    return (proc.stderr.read().strip().splitlines() or [f"exit {proc.returncode}"])[-1]
