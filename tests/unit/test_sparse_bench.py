"""`gossip bench sparse`: one tiny real run on loopback, the tables, and its argument errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gossip.bench import sparse
from gossip.cli import main
from gossip.errors import ConfigError


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_runs_every_contender_and_reports_bytes_per_peer():
    only = "ring-allreduce,topk-allgather,gtopk,spardl,spardl:int32"
    result = CliRunner().invoke(main, ["bench", "sparse", "--peers", "3", "--size", "30001",
                                       "--density", "0.01", "--reps", "2", "--warmup", "0",
                                       "--only", only])
    assert result.exit_code == 0, result.output
    times, _ = result.output.split("\n\n")
    lines = times.splitlines()
    assert "k=301, SparDL k_b=101" in lines[0]
    rows = {line.split()[1]: line.split() for line in lines[3:]}
    assert list(rows)[:5] == ["ring-allreduce", "topk-allgather", "gtopk", "spardl",
                              "spardl:int32"]
    sent = {name: float(row[5]) for name, row in rows.items()}
    # Dense ring: 2 (P-1)/P of 120 kB; topk-allgather: (P-1) sets of 301 pairs; spardl:
    # 2 (P-1) blocks of 101 pairs; int32 indices cost more than compact ones.
    assert sent["ring-allreduce"] > 80
    assert sent["topk-allgather"] > sent["spardl"]
    assert sent["spardl:int32"] > sent["spardl"]
    assert "where the sparse strategies' time goes" in result.output


@pytest.mark.parametrize("kwargs, error", [
    ({"contenders": ["ring-allreduce:int32"]}, "unknown contender"),
    ({"contenders": ["nope"]}, "unknown contender 'nope'"),
    ({"rate": "1gbit"}, "--rate: only with --netns"),
    ({"reps": 0}, "must be >= 1"),
])
def test_bad_arguments_are_config_errors(kwargs, error):
    with pytest.raises(ConfigError, match=error):
        sparse.run(2, 100, 0.1, **kwargs)


def test_tables_from_reports():
    record = {"seconds": 0.5, "cpu": 0.1, "sent": 100, "recv": 90,
              "phases": {"total": 0.4, "select": 0.1, "recv": 0.25, "wait": 0.2},
              "phases_cpu": {"total": 0.1, "select": 0.05}}
    reports = [{"results": {"ring-allreduce": [dict(record, seconds=1.0)],
                            "spardl": [dict(record, seconds=s)]}} for s in (0.2, 0.4)]
    summary = sparse.summarize(reports)
    assert summary["spardl"]["seconds"] == 0.4  # the slowest peer
    assert summary["spardl"]["phases"]["recv"] == pytest.approx(0.05)  # without the wait
    times = sparse.time_table({2: summary})
    assert "2.5" in times.splitlines()[3]  # ring / spardl
    phases = sparse.phase_table({2: summary})
    assert [line.split()[1:3] for line in phases.splitlines()[2:]] == [["spardl", "wall"],
                                                                        ["spardl", "cpu"]]
