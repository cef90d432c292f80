"""free_ports: distinct ports, outside the ephemeral range, free, never handed out twice."""

from __future__ import annotations

import socket
import threading

import pytest

from gossip import ports as ports_module
from gossip.errors import TransportError
from gossip.ports import PortPicker, ephemeral_port_range, free_ports, port_pool


def held(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = ephemeral_port_range()
    ports = free_ports(50)
    assert len(set(ports)) == 50
    assert not any(low <= port <= high for port in ports), (low, high, ports)
    for port in ports[:5]:
        held(port).close()


def test_calls_in_one_process_never_repeat_a_port():
    seen = [port for _ in range(100) for port in free_ports(7)]
    assert len(seen) == len(set(seen))


def test_concurrent_calls_get_disjoint_ports():
    got: list[list[int]] = []

    def take():
        got.append(free_ports(20))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    everything = [port for ports in got for port in ports]
    assert len(got) == 4 and len(set(everything)) == 80


def test_a_port_in_use_is_skipped():
    a, b, c = free_ports(3)
    with held(a):
        assert PortPicker([a, b, c], start=0).take(2) == [b, c]


def test_the_cursor_wraps_around_and_an_exhausted_pool_is_named():
    a, b, c = free_ports(3)
    picker = PortPicker([a, b, c], start=1)
    assert picker.take(2) == [b, c]
    assert picker.take(2) == [a, b]  # round again: the oldest first
    exhausted = f"only 2 of 3 ports free on 127.0.0.1 among 3 from {a} to {c}"
    with held(c), pytest.raises(TransportError, match=exhausted):
        picker.take(3)


def test_the_pool_is_the_larger_side_outside_the_ephemeral_range():
    assert port_pool((32_768, 60_999)) == range(ports_module.FIRST_PORT, 32_768)  # Linux default
    assert port_pool((1_024, 20_000)) == range(20_001, 65_536)
    assert port_pool((1_024, 65_000)) is None  # no room: the kernel's choice it is


def test_the_kernel_range_is_read_or_defaults(tmp_path):
    (tmp_path / "range").write_text("32768\t60999\n")
    assert ephemeral_port_range(tmp_path / "range") == (32_768, 60_999)
    assert ephemeral_port_range(tmp_path / "missing") == ports_module.DEFAULT_EPHEMERAL
    (tmp_path / "range").write_text("garbage\n")
    assert ephemeral_port_range(tmp_path / "range") == ports_module.DEFAULT_EPHEMERAL


def test_without_a_pool_the_kernel_chooses_distinct_ports(monkeypatch):
    monkeypatch.setattr(ports_module, "_picker", None)
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(port > 0 for port in ports)
