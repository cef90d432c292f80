"""The command line as a user runs it: real `gossip` processes, real sockets, run directories.
Errors that no process boundary is part of (a refused launch, a failing `gossip peer`) run
in-process (``cli``): interpreter and torch start-up cost seconds on two busy cores; one real
process keeps the exit path tested."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gossip.cli import main
from gossip.metrics import read_jsonl
from gossip.ports import free_ports

REQUIRED_FIELDS = {"round", "time", "loss", "accuracy", "bytes_sent", "bytes_recv", "compute_s",
                   "comm_s", "wait_s"}


def gossip(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "gossip", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def cli(*args: str, env: dict | None = None):
    """`gossip ARGS` in-process, with ``returncode`` and ``stderr`` as a finished process
    has them."""
    result = CliRunner().invoke(main, list(args), env=env)
    result.returncode = result.exit_code
    return result


def error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def write_topology(path: Path, ports: list[int], edges: list[list[int]]) -> Path:
    path.write_text(yaml.safe_dump({
        "peers": [{"rank": r, "host": "127.0.0.1", "port": p} for r, p in enumerate(ports)],
        "edges": edges}))
    return path


@pytest.mark.slow
def test_demo_reaches_90_percent_and_writes_the_run_directory(tmp_path):
    result = gossip("launch", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / result.stdout.strip().splitlines()[-1].split(": ", 1)[1]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["strategy"] == "dpsgd" and len(config["topology"]["peers"]) == 4
    for rank in range(4):
        records = read_jsonl(run_dir / f"peer-{rank}.jsonl")
        assert [r["round"] for r in records] == list(range(config["train"]["rounds"]))
        assert REQUIRED_FIELDS <= set(records[-1])
        assert records[-1]["accuracy"] >= 0.90
        assert records[-1]["consensus"] < 1e-2
        assert records[-1]["bytes_sent"] > 0
    assert "mean test accuracy" in result.stdout


@pytest.mark.slow
def test_launch_ring_allreduce_from_a_topology_file(tmp_path):
    topo = write_topology(tmp_path / "t.yaml", free_ports(3), [[0, 1], [1, 2]])
    result = gossip("launch", "--topology", str(topo), "--strategy", "ring-allreduce",
                    "--rounds", "30", "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    last = [read_jsonl(tmp_path / "run" / f"peer-{r}.jsonl")[-1] for r in range(3)]
    # Gradient averaging keeps every model identical.
    assert last[0]["consensus"] == pytest.approx(0.0, abs=1e-10)
    assert len({r["accuracy"] for r in last}) == 1


@pytest.mark.parametrize("args, culprit", [  # the fast lane runs the last: a real `gossip`
    pytest.param(["launch", "--strategy", "nope"], "unknown strategy 'nope'; available: adpsgd, dpsgd, ",
                 marks=pytest.mark.slow),
    pytest.param(["launch", "--option", "bogus=1"], "has no option 'bogus'",
                 marks=pytest.mark.slow),
    pytest.param(["launch", "--rounds", "0"], "rounds", marks=pytest.mark.slow),
    (["topology", "show", "missing.yaml"], "missing.yaml: no such file"),
])
def test_bad_input_is_one_line_and_exit_1(tmp_path, monkeypatch, args, culprit):
    if args[0] == "launch":  # refused before any peer starts
        monkeypatch.chdir(tmp_path)
        result = cli(*args)
    else:
        result = gossip(*args, cwd=tmp_path)
    assert result.returncode == 1
    assert culprit in error_line(result)


@pytest.mark.slow
def test_malformed_topology_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("peers: [\n  - {rank: 0\n")
    for args in (["topology", "show", "bad.yaml"], ["launch", "--topology", "bad.yaml"],
                 ["peer", "--rank", "0", "--topology", "bad.yaml"]):
        result = cli(*args)
        assert result.returncode == 1
        assert error_line(result).startswith("error: bad.yaml: invalid YAML at line")


@pytest.mark.slow
def test_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        topo = write_topology(tmp_path / "t.yaml", [port, *free_ports(1)], [[0, 1]])
        result = cli("peer", "--rank", "0", "--topology", str(topo), "--run-dir",
                     str(tmp_path))
        assert result.returncode == 1
        assert f"cannot listen on tcp://127.0.0.1:{port}" in error_line(result)
        # launch names the peer that failed and stops the other one.
        result = gossip("launch", "--topology", str(topo), "--timeout", "20", cwd=tmp_path)
        assert result.returncode == 1
        assert "peer 0 failed" in error_line(result)


@pytest.mark.slow
def test_unreachable_peer_times_out_naming_it(tmp_path):
    ports = free_ports(2)
    topo = write_topology(tmp_path / "t.yaml", ports, [[0, 1]])
    result = cli("peer", "--topology", str(topo), "--timeout", "2", "--quiet", "--run-dir",
                 str(tmp_path), env={"RANK": "0"})
    assert result.returncode == 1
    line = error_line(result)
    assert f"peer 1 (tcp://127.0.0.1:{ports[1]})" in line and "round 0" in line


@pytest.mark.slow
def test_rank_from_environment_must_be_an_integer(tmp_path):
    topo = write_topology(tmp_path / "t.yaml", free_ports(2), [[0, 1]])
    result = cli("peer", "--topology", str(topo), "--run-dir", str(tmp_path),
                 env={"RANK": "", "SLURM_PROCID": "x"})
    assert result.returncode == 1
    assert "$SLURM_PROCID='x' is not a rank" in error_line(result)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [[], ["--overlap", "--bucket-mb", "0.001"]],
                         ids=["blocking", "overlap"])
def test_launch_with_a_parameter_server_rank_that_only_serves(overlap, tmp_path):
    """`gossip peer` dispatches on the role: rank 0 serves (no metrics), the workers train
    with the same model every round (sync ps is an exact mean); with overlap the server,
    which attaches no model, serves every bucket."""
    ports = free_ports(3)
    topo = tmp_path / "ps.yaml"
    topo.write_text(yaml.safe_dump({"size": 3, "base_port": ports[0], "servers": [0]}))
    result = gossip("launch", "--topology", str(topo), "--strategy", "ps", "--rounds", "5",
                    "--run-dir", "run", *overlap, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run" / "peer-0.jsonl").exists()
    last = [read_jsonl(tmp_path / "run" / f"peer-{r}.jsonl")[-1] for r in (1, 2)]
    assert last[0]["round"] == 4 and last[0]["accuracy"] == last[1]["accuracy"]
    assert "a rank only serves" in result.stdout
    if overlap:
        assert last[0]["buckets"] > 1
