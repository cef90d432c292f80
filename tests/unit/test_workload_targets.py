"""Time and bytes to a target quality (gossip/experiment/targets.py) and the time model beside
them (gossip/experiment/timemodel.py), on hand-written run directories."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from gossip.errors import ConfigError
from gossip.experiment.analysis import load_curve
from gossip.experiment.spec import parse_experiment
from gossip.experiment.targets import Target, median_or_none, reach, target_rows
from gossip.experiment.timemodel import (break_even, comm_bound_rate, model_rows, step_seconds,
                                         time_model_alpha)


def write_run(run_dir, *, accuracy, compute=0.1, comm=0.2, evaluation=1.0, sent=1000,
              seed=0, strategy="ring-allreduce", rate=None, task="digits", peers=2,
              comm_skew=0.0):
    """``peers`` peers of len(accuracy) rounds: each round ``compute`` + ``comm`` seconds of
    training, then ``evaluation`` seconds of evaluation (in ``time``, not in the timings);
    peer 0's step also waits ``comm_skew`` for peer 1's evaluation."""
    run_dir.mkdir()
    config = {"train": {"strategy": strategy, "task": task, "seed": seed},
              "ranks": list(range(peers)), "run": run_dir.name}
    if rate is not None:
        config["netns"] = {"rate": rate}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    for rank in range(peers):
        lines, clock = [], 0.0
        step = comm + (comm_skew if rank == 0 else 0.0)
        for round, acc in enumerate(accuracy):
            clock += compute + step + evaluation
            lines.append({"round": round, "time": clock, "wall": 100.0 + clock, "loss": 1.0,
                          "accuracy": acc, "bytes_sent": sent * (round + 1),
                          "bytes_recv": sent * (round + 1), "compute_s": compute,
                          "comm_s": step, "samples": 8, "minibatches": 1})
        (run_dir / f"peer-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n"
                                                            for x in lines))
    return load_curve(run_dir, smooth=1)


def test_time_to_target_excludes_evaluation_and_counts_steps_and_bytes(tmp_path):
    # Peer 0's steps also waited 0.5 s for peer 1's evaluation: not training time either.
    curve = write_run(tmp_path / "a", accuracy=[0.2, 0.5, 0.8, 0.9], comm_skew=0.5)
    assert curve.train_time.tolist() == pytest.approx([0.3, 0.6, 0.9, 1.2])
    hit = reach(curve, Target(value=0.8), 0.8)
    assert (hit.steps, hit.time, hit.bytes) == (3, pytest.approx(0.9), 3000)
    assert reach(curve, Target(value=0.95), 0.95).steps is None


def test_relative_targets_are_medians_over_the_baselines_seeds_per_setting(tmp_path):
    curves = [
        write_run(tmp_path / "dense", accuracy=[0.5, 0.9, 1.0], comm=0.9, seed=0),
        write_run(tmp_path / "dense-s1", accuracy=[0.5, 0.8, 0.8], comm=0.9, seed=1),
        write_run(tmp_path / "dense-s2", accuracy=[0.5, 0.7, 0.9], comm=0.9, seed=2),
        write_run(tmp_path / "sparse", accuracy=[0.86, 0.9, 0.9], strategy="gtopk", sent=10),
        # Another task: its own baseline (none here), so no level and no ratios.
        write_run(tmp_path / "other", accuracy=[0.9, 0.9, 0.9], task="deep-mlp"),
    ]
    rows = {r["arm"]: r for r in target_rows(curves, Target(fraction=0.95), ["dense"])}
    dense = rows["dense+dense-s1+dense-s2"]
    assert dense["seeds"] == 3
    assert dense["level"] == pytest.approx(0.95 * 0.9)  # median of 1.0, 0.8, 0.9
    # Seeds reach 0.855 at steps 2, never, 3: median 3, time 3 s, 3000 bytes.
    assert (dense["steps"], dense["time s"], dense["MB"]) == (3, pytest.approx(3.0), 0.003)
    sparse = rows["sparse"]
    assert (sparse["steps"], sparse["time s"]) == (1, pytest.approx(0.3))
    assert sparse["time x"] == pytest.approx(10.0)
    assert sparse["bytes x"] == pytest.approx(300.0)
    assert sparse["final diff"] == pytest.approx(0.0)
    assert rows["other"]["level"] is None and rows["other"]["time x"] is None


def test_a_loss_target_is_the_baselines_final_plus_a_margin(tmp_path):
    base = write_run(tmp_path / "dense", accuracy=[0.1, 0.2])
    target = Target(metric="loss", margin=0.05)
    assert target_rows([base], target, ["dense"])[0]["level"] == pytest.approx(1.05)
    assert not target.higher and Target(value=0.5).higher


def test_median_counts_never_as_later_than_any_time():
    assert median_or_none([1.0, None, 3.0]) == 3.0
    assert median_or_none([1.0, None]) is None
    assert median_or_none([2.0, 4.0]) == 3.0
    assert median_or_none([]) is None


def test_time_model_arithmetic():
    # C + V/B + n alpha: 0.5 s + 1 MB at 10 MB/s + 14 x 1 ms
    assert step_seconds(0.5, 1e6, 1e7, 14, 0.001) == pytest.approx(0.614)
    assert step_seconds(0.5, 1e6, None, None, 0.001) == 0.5  # uncapped, pattern unknown


def test_break_even_rate_is_the_specs_example():
    # ResNet w 0.25, P 8: V_d 4.9 MB, PowerSGD r 2 0.14 MB, C 0.7 s, s 1.1 => ~540 Mbit/s
    rate, where = break_even(4.9e6, 0.7, 0.14e6, 0.7, 1.1)
    assert where == "below"
    assert rate * 8 / 1e6 == pytest.approx((4.9 - 1.1 * 0.14) / (0.1 * 0.7) * 8)
    assert 530 < rate * 8 / 1e6 < 550
    # Both sides of B*: equal times there.
    t_dense = step_seconds(0.7, 4.9e6, rate, 0, 0)
    assert 1.1 * step_seconds(0.7, 0.14e6, rate, 0, 0) == pytest.approx(t_dense)
    assert break_even(4.9e6, 0.7, 0.14e6, 0.7, 1.0) == (math.inf, "always")
    assert break_even(1e6, 0.7, 2e6, 0.7, 1.5) == (0.0, "never")
    rate, where = break_even(1e6, 0.7, 2e6, 0.5, 1.0)  # more bytes, less compute
    assert where == "above" and rate == pytest.approx(1e6 / 0.2)


def test_communication_bound_rate():
    # V/B = 2 C: 1 MB in 0.2 s per step at C = 0.1 s
    assert comm_bound_rate(1e6, 0.1, None, 0.0) == pytest.approx(5e6)
    assert comm_bound_rate(1e6, 0.1, 10, 0.001) == pytest.approx(1e6 / 0.19)
    assert comm_bound_rate(1e6, 0.001, 10, 0.001) == math.inf


def test_model_rows_measure_c_and_v_and_compare_with_the_baseline(tmp_path):
    dense = write_run(tmp_path / "dense", accuracy=[0.5, 0.9, 1.0], compute=0.1, comm=0.4,
                      sent=1_000_000, rate="20mbit")
    sparse = write_run(tmp_path / "sparse", accuracy=[0.5, 0.9, 1.0], compute=0.1, comm=0.1,
                       sent=10_000, rate="20mbit", strategy="gtopk")
    rows = {r["arm"]: r for r in model_rows([dense, sparse], baselines=["dense"],
                                            target=Target(value=0.9), alpha=0.0)}
    d, s = rows["dense"], rows["sparse"]
    assert (d["C s"], d["V MB"], d["B Mbit/s"], d["steps"]) == (pytest.approx(0.1), 1.0, 20, 2)
    assert d["model s"] == pytest.approx(2 * (0.1 + 1e6 / 2.5e6))  # 1 MB at 2.5 MB/s
    assert d["measured s"] == pytest.approx(1.0)
    assert d["comm %"] == pytest.approx(80.0)
    assert d["B_2/3 Mbit/s"] == pytest.approx(1e6 / 0.2 * 8 / 1e6)
    assert s["pays"] == "always" and s["B* Mbit/s"] == math.inf
    # The measured step is exactly C + V/B: no per-message cost left (n = 2(P-1) = 2).
    assert (d["n"], d["alpha fit s"]) == (2, pytest.approx(0.0, abs=1e-12))


def test_target_and_time_model_errors_name_the_field():
    with pytest.raises(ConfigError, match="exactly one of"):
        Target.from_mapping({"metric": "accuracy"}, "target")
    with pytest.raises(ConfigError, match="target: metric must be one of .*, got 'top5'"):
        Target.from_mapping({"metric": "top5", "value": 0.5}, "target")
    with pytest.raises(ConfigError, match="lower-is-better"):
        Target.from_mapping({"metric": "loss", "fraction": 0.95}, "target")
    with pytest.raises(ConfigError, match=r"fraction must be in \(0, 1\], got 1.5"):
        Target.from_mapping({"fraction": 1.5}, "target")
    with pytest.raises(ConfigError, match="time_model: alpha must be >= 0, got -1"):
        time_model_alpha({"alpha": -1})
    base = {"train": {"task": "digits"}, "runs": [{"name": "a"}]}
    with pytest.raises(ConfigError, match="x.yaml: target: unknown field 'level'"):
        parse_experiment({**base, "target": {"level": 0.9}}, source="x.yaml")
    with pytest.raises(ConfigError, match=r"runs \(b\): target: give exactly one"):
        parse_experiment({**base, "runs": [{"name": "a"}, {"name": "b", "target": {}}]})
    # Two tasks in one file: a run's own target replaces the file's.
    spec = parse_experiment({**base, "target": {"metric": "accuracy", "fraction": 0.95},
                             "time_model": {"alpha": 0.0002},
                             "runs": [{"name": "cnn"},
                                      {"name": "lm", "target": {"metric": "test_loss",
                                                                "margin": 0.05}}]})
    assert spec.targets == {"cnn": Target(fraction=0.95),
                            "lm": Target(metric="test_loss", margin=0.05)}
    assert spec.alpha == 0.0002


def test_report_tabulates_each_target_and_the_time_model_and_plots_per_setting(tmp_path):
    from gossip.experiment.report import report

    write_run(tmp_path / "cnn-dense", accuracy=[0.5, 0.9, 1.0], comm=0.9, sent=10**6,
              rate="20mbit")
    write_run(tmp_path / "cnn-sparse", accuracy=[0.9, 0.95, 1.0], sent=10**4,
              rate="20mbit", strategy="gtopk")
    write_run(tmp_path / "lm-dense", accuracy=[0.1, 0.2, 0.3], task="deep-mlp",
              rate="20mbit")
    (tmp_path / "experiment.yaml").write_text(yaml.safe_dump({
        "name": "two-tasks", "baseline": ["cnn-dense", "lm-dense"],
        "target": {"metric": "accuracy", "fraction": 0.95},
        "runs": [{"name": "cnn-dense"}, {"name": "cnn-sparse"},
                 {"name": "lm-dense", "target": {"metric": "loss", "margin": 0.05}}]}))
    lines = []
    report(tmp_path, echo=lines.append)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["to_target"]) == {"accuracy >= 0.95 x baseline's final",
                                         "loss <= baseline's final + 0.05"}
    assert [r["arm"] for r in summary["time_model"]] == ["cnn-dense", "cnn-sparse", "lm-dense"]
    assert "time model T = steps x (C + V/B + n alpha)" in lines[0]
    for name in ("accuracy_vs_time-0-digits-20mbit.png", "accuracy_vs_bytes-0-digits-20mbit.png",
                 "loss_vs_time-1-deep-mlp-20mbit.png", "loss_vs_time.png", "accuracy_vs_time.png"):
        assert (tmp_path / name).exists(), name


@pytest.mark.slow  # peer processes
@pytest.mark.timeout(300)
def test_a_tiny_workloads_experiment_runs_end_to_end(tmp_path):
    import os
    import subprocess
    import sys

    spec = {"name": "tiny-workloads", "peers": 3, "graph": "ring", "baseline": "dense",
            "target": {"metric": "accuracy", "fraction": 0.5},
            "time_model": {"alpha": 0.001},
            "train": {"task": "digits", "rounds": 12, "batch_size": 16, "eval_every": 6},
            "runs": [{"name": "dense", "strategy": "ring-allreduce"},
                     {"name": "local4", "strategy": "local", "options": {"period": 4}}]}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    result = subprocess.run([sys.executable, "-m", "gossip", "experiment", "run", "exp.yaml",
                             "--out", "out"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240, env=dict(os.environ), check=False)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = {r["arm"]: r for r in summary["to_target"]["accuracy >= 0.5 x baseline's final"]}
    assert rows["dense"]["steps"] is not None and rows["dense"]["time x"] == 1.0
    model = {r["arm"]: r for r in summary["time_model"]}
    assert model["dense"]["n"] == 4 and model["dense"]["model s"] > 0  # 2(P-1) ring steps
    assert (tmp_path / "out" / "accuracy_vs_time.png").exists()
