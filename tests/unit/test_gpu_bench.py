"""`gossip bench gpu` without a GPU: it refuses in one line, and its in-process parts run
on CPU tensors (the multi-process parts are run by hand on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from gossip.bench import gpu
from gossip.cli.common import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the command runs")
def test_without_cuda_the_command_says_so_in_one_line_and_fails():
    result = CliRunner().invoke(main, ["bench", "gpu"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: gossip bench gpu needs a CUDA device: torch.cuda.is_available() is False "
        "here, nothing measured"]


def test_the_copy_and_topk_parts_run_on_cpu_tensors():
    lines = []
    rows = gpu.bandwidth(torch.device("cpu"), [1], reps=1, echo=lines.append)
    assert rows[0]["MB"] == 1 and all(v > 0 for v in rows[0].values())
    assert "link unknown" in lines[0]
    result = gpu.device_topk(torch.device("cpu"), 50_000, 0.01, reps=1, echo=lines.append)
    assert result["payload MB"] < 50_000 * 4 / gpu.MB / 10 and result["speed-up"] > 0


def test_the_pcie_bound_follows_generation_and_width(monkeypatch):
    monkeypatch.setattr(gpu.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    class Done:
        stdout = "4, 8, 5, 16\n"

    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: Done())
    link, bound = gpu.pcie_link(torch.device("cuda", 0))
    assert link == "Gen5 x16 (now Gen4 x8)"
    assert bound == pytest.approx(32 * 16 * 128 / 130 / 8)  # 63 GB/s
