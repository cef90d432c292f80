"""`gossip bench compress` runs end to end on a small tensor and reports every compressor."""

from __future__ import annotations

from click.testing import CliRunner

from gossip.bench import compress as bench
from gossip.cli import main


def test_run_reports_every_compressor_and_an_exact_selection():
    lines = []
    result = bench.run(600_000, 0.01, reps=1, echo=lines.append)
    labels = [row["compressor"] for row in result["rows"]]
    assert labels == list(bench.contenders(0.01, 1.0))
    assert result["selection"]["recall"] == 1.0 and result["selection"]["selected"] == 6000
    rows = {row["compressor"]: row for row in result["rows"]}
    assert rows["none"]["x dense"] == 1.0 and rows["fp16"]["x dense"] < 0.51
    assert rows["topk sampled"]["wire bytes"] == rows["topk exact"]["wire bytes"]
    assert "torch.topk" in lines[1] and "x torch.topk" in lines[2]


def test_cli_command():
    out = CliRunner().invoke(main, ["bench", "compress", "--size", "20k", "--reps", "1",
                                    "--density", "0.05"])
    assert out.exit_code == 0, out.output
    assert "topk sampled" in out.output and "k = 1,000" in out.output
