"""An asynchronous run's curve (gossip/experiment/analysis.py): its records in wall-clock
order, P at a time, whoever wrote them; a synchronous run's rows stay round by round."""

from __future__ import annotations

import json

import pytest
import yaml

from gossip.experiment.analysis import load_curve


def write_run(run_dir, strategy: str, walls: list[list[float]]) -> None:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"train": {"strategy": strategy}}))
    for rank, peer_walls in enumerate(walls):
        lines = [{"round": round, "time": wall, "wall": 100.0 + wall,
                  "loss": float(rank), "accuracy": 0.5, "bytes_sent": 10 * (round + 1),
                  "samples": 8, "minibatches": 1}
                 for round, wall in enumerate(peer_walls)]
        (run_dir / f"peer-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_an_asynchronous_run_is_read_in_wall_clock_order(tmp_path):
    # Peer 0 is fast (4 steps), peer 1 slow (2 steps); both started at wall 0.
    write_run(tmp_path / "async", "adpsgd", [[1.0, 2.0, 3.0, 4.0], [2.5, 5.0]])
    curve = load_curve(tmp_path / "async", smooth=1)
    # records by wall: 1 (p0), 2 (p0) | 2.5 (p1), 3 (p0) | 4 (p0), 5 (p1)
    assert curve.time.tolist() == [2.0, 3.0, 5.0]
    assert curve.raw_loss.tolist() == [0.0, 0.5, 0.5]
    assert curve.minibatch_share == pytest.approx(1.0)


def test_a_synchronous_run_still_counts_rounds_all_peers_finished(tmp_path):
    write_run(tmp_path / "sync", "dpsgd", [[1.0, 2.0, 3.0, 4.0], [2.5, 5.0]])
    curve = load_curve(tmp_path / "sync", smooth=1)
    assert curve.time.tolist() == [2.5, 5.0]


def test_runs_that_differ_only_in_their_stragglers_are_told_apart_in_the_plots(tmp_path):
    """A plot's colour is a run's family; the same strategy under other injected delays
    (e.g. transient stragglers only) is another family, not a second line of one colour."""
    families = []
    for name, delays in (("a", {"compute": 0.01}), ("b", {"compute": 0.01}),
                         ("c", {"compute": 0.01, "slowdown": {1: 4.0}})):
        write_run(tmp_path / name, "dpsgd", [[1.0, 2.0], [1.5, 2.5]])
        config = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
        config["train"]["delays"] = delays
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(config))
        families.append(load_curve(tmp_path / name, smooth=1).family)
    assert families[0] == families[1] != families[2]


def test_a_wrapper_is_drawn_in_its_inner_strategys_family(tmp_path):
    """Wrappers are known by their ``wraps`` capability: a nonblocking dpsgd shares dpsgd's
    colour (dashed), a local SGD run keeps its period in its family."""
    curves = {}
    for name, strategy, options in (("plain", "dpsgd", {}),
                                     ("nb", "nonblocking", {"inner": "dpsgd"}),
                                     ("local", "local", {"period": 4})):
        write_run(tmp_path / name, strategy, [[1.0, 2.0], [1.5, 2.5]])
        config = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
        config["train"]["options"] = options
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(config))
        curves[name] = load_curve(tmp_path / name, smooth=1)
    assert (curves["plain"].label, curves["plain"].nonblocking) == ("dpsgd", False)
    assert (curves["nb"].label, curves["nb"].nonblocking) == ("nonblocking(dpsgd)", True)
    assert curves["nb"].family == curves["plain"].family
    assert curves["local"].label == "local(ring-allreduce)"
    assert curves["local"].family.startswith('ring-allreduce{"period": 4}')
