"""The lock-file devices, the device section of a config, the crossover experiment file."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from gossip.cli import main
from gossip.crossover.connect import DeviceConfig, device_config
from gossip.crossover.experiment import load_crossover
from gossip.crossover.flock import FlockDevice, SlicedDevice
from gossip.crossover.grants import overlaps, read_grants
from gossip.errors import ConfigError, PeerTimeout


def test_a_flock_device_is_exclusive_and_names_its_holder(tmp_path):
    log = tmp_path / "grants.jsonl"
    with FlockDevice(tmp_path, "d0", "a", 2, grant_log=log) as a, \
            FlockDevice(tmp_path, "d0", "b", 0, timeout=0.02, grant_log=log) as b:
        with a.compute(5):
            with pytest.raises(PeerTimeout, match=r"device d0 .* held by job a rank 2 \(round 5\)"):
                b.acquire(0)
        with b.compute(0):
            pass
    assert [g["job"] for g in read_grants(log)] == ["a", "b"] and overlaps(read_grants(log)) == []


def test_a_sliced_device_holds_only_its_slices(tmp_path):
    log = tmp_path / "grants.jsonl"
    with SlicedDevice(tmp_path, "d0", "a", 0, slice_s=0.01, grant_log=log) as a:
        with a.compute(0) as hold:
            a.sleep(0.035)
    assert len(read_grants(log)) == 4 and hold.hold_s >= 0.035


def test_the_device_section_and_its_errors(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("train: {}\ndevice: {arbiter: 'flock:/tmp/x', job: a}\n")
    assert device_config(config, device="gpu{rank}") == DeviceConfig(
        "flock:/tmp/x", device="gpu{rank}", job="a")
    assert device_config(None) is None
    with pytest.raises(ConfigError, match="need --arbiter"):
        device_config(None, job="a")
    with pytest.raises(ConfigError, match="arbiter 'http://x'"):
        device_config(None, arbiter="http://x")
    with pytest.raises(ConfigError, match="unknown field 'color'"):
        DeviceConfig.from_dict({"arbiter": "flock:/x", "color": 1})


@pytest.mark.parametrize("text, error", [
    ("points: []", "points: expected a non-empty list"),
    ("points: [{name: x, arms: [crossover]}]", "the sequential arm is the baseline"),
    ("points: [{name: x, arms: [sequential, fast]}]", "'fast' is not one of"),
    ("points: [{name: x, train: {rounds: 0}}]", r"points\[0\]: rounds: 0"),
    ("repeats: 0\npoints: [{name: x}]", "repeats: expected a positive integer"),
    ("jobs: [a, a]\npoints: [{name: x}]", "jobs: expected a list of distinct names"),
])
def test_experiment_file_errors_name_the_field(tmp_path, text, error):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_crossover(path)


def test_the_shipped_experiment_parses():
    spec = load_crossover("experiments/crossover.yaml")
    assert spec.jobs == ("a", "b") and spec.repeats >= 3
    assert {arm for point in spec.points for arm in point.arms} == {
        "sequential", "naive", "crossover", "fifo"}


@pytest.mark.parametrize("address, culprit", [
    ("tcp://127.0.0.1", "tcp://HOST:PORT"), ("tcp://127.0.0.1:", "tcp://HOST:PORT"),
    ("tcp://:5555", "tcp://HOST:PORT"), ("tcp://h:http", "tcp://HOST:PORT"),
    ("tcp://h:70000", "tcp://HOST:PORT"), ("tcp://h:*", "tcp://HOST:PORT"),
    ("ipc://", "ipc://PATH"), ("ipc:///" + "x" * 120, "at most 107 bytes"),
    ("flock:", "flock:DIR"), ("slices:", "slices:DIR"),
])
def test_an_address_without_its_parts_is_refused(address, culprit):
    # Accepted before: every peer started, then died with a zmq traceback.
    with pytest.raises(ConfigError, match=f"arbiter '{re.escape(address[:12])}.*{culprit}"):
        device_config(None, arbiter=address)


@pytest.mark.parametrize("field", ["job", "device"])
def test_a_name_the_arbiter_would_reject_is_refused(field):
    # Over 256 characters every message of the rank was rejected by the arbiter.
    with pytest.raises(ConfigError, match=f"device: {field} 'xxx.*at most 256"):
        device_config(None, arbiter="ipc:///tmp/a.sock", **{field: "x" * 257})


def test_launch_refuses_a_bad_arbiter_address_before_any_peer_starts(tmp_path):
    result = CliRunner().invoke(main, ["launch", "--peers", "2", "--rounds", "1",
                                       "--run-dir", str(tmp_path / "run"),
                                       "--arbiter", "tcp://127.0.0.1"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "tcp://127.0.0.1" in lines[0]
    assert not list(tmp_path.glob("run/peer-*"))
