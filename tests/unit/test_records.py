"""The metrics schema: a Record's fields are the keys of its JSONL line, in order; lines read
back give the same Record; the lines a restarted peer writes again for the rounds before it
rejoined."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gossip.metrics import MetricsWriter, read_jsonl
from gossip.training.records import Record, lines_before

SCHEMA = ["round", "time", "wall", "loss", "accuracy", "bytes_sent", "bytes_recv", "compute_s",
          "delay_s", "comm_s", "wait_s", "minibatches", "samples", "consensus", "avg_accuracy",
          "lost_peers"]
DEVICE = ["device_wait_s", "device_hold_s", "round_start_wall"]
OVERLAP = ["exposed_comm_s", "comm_busy_s", "iter_s", "buckets"]
ROBUST = ["robust_share", "robust_flagged"]
TASK = ["test_loss", "perplexity"]
ELASTIC = ["epoch", "state_hash"]
# written when set
OPTIONAL = ["resumed_from", "lost_work", *DEVICE, *OVERLAP, "staleness", *ROBUST, *TASK,
            *ELASTIC]


def record(round: int = 3, **changes) -> Record:
    fields = dict(round=round, time=1.25, wall=1.7e9 + round, loss=0.5, accuracy=0.75,
                  bytes_sent=1000 * (round + 1), bytes_recv=990 * (round + 1), compute_s=0.01,
                  delay_s=0.0, comm_s=0.02, wait_s=0.005, minibatches=2, samples=32,
                  consensus=1e-3, avg_accuracy=0.8, lost_peers={5: 2})
    return Record(**{**fields, **changes})


def test_the_fields_are_the_schema_in_order():
    assert [f.name for f in dataclasses.fields(Record)] == SCHEMA + OPTIONAL
    assert list(record().as_dict()) == SCHEMA


def test_optional_fields_appear_only_when_set():
    assert list(record(resumed_from=10).as_dict()) == SCHEMA + ["resumed_from"]
    assert record(resumed_from=0).as_dict()["resumed_from"] == 0  # round 0 is a round
    assert list(record(lost_work=True).as_dict()) == SCHEMA + ["lost_work"]
    overlapped = record(exposed_comm_s=0.0, comm_busy_s=0.5, iter_s=1.0, buckets=3)
    assert list(overlapped.as_dict()) == SCHEMA + OVERLAP
    shared = record(device_wait_s=0.0, device_hold_s=0.1, round_start_wall=1.7e9).as_dict()
    assert list(shared) == SCHEMA + DEVICE and shared["device_wait_s"] == 0.0
    assert list(record(staleness=0).as_dict()) == SCHEMA + ["staleness"]  # s > 0: even 0
    assert list(record(test_loss=2.0, perplexity=7.4).as_dict()) == SCHEMA + TASK  # an LM's
    assert list(record(robust_share=0.0, robust_flagged=0).as_dict()) == SCHEMA + ROBUST
    assert list(record(epoch=0, state_hash="00").as_dict()) == SCHEMA + ELASTIC


@pytest.mark.parametrize("changes", [{}, {"resumed_from": 7}, {"staleness": 2},
                                     {"consensus": None, "avg_accuracy": None}],
                         ids=["measured", "resumed", "stale", "not-measured"])
def test_a_line_read_back_is_the_same_record(tmp_path, changes):
    original = record(**changes)
    with MetricsWriter(tmp_path / "peer-0.jsonl") as metrics:
        metrics.write(original.as_dict())
    [line] = read_jsonl(tmp_path / "peer-0.jsonl")
    assert list(line) == list(original.as_dict())
    assert line["lost_peers"] == {"5": 2}  # JSON keys are strings ...
    assert Record.from_dict(line) == original  # ... and ranks again once read back


def test_a_loss_of_no_minibatch_is_nan_in_the_record_and_null_in_the_file(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as metrics:
        metrics.write(record(loss=math.nan, minibatches=0, samples=0).as_dict())
    assert Record.from_dict(read_jsonl(tmp_path / "m.jsonl")[0]).loss is None


def test_an_unknown_key_is_not_a_record():
    with pytest.raises(TypeError, match="bogus"):
        Record.from_dict({**record().as_dict(), "bogus": 1})


def test_a_lost_work_line_keeps_time_and_bytes_of_the_line_before():
    previous = record(4).as_dict()
    line = Record.of_lost_work(5, previous=previous, bytes_counted=(1, 2), lost_peers={},
                               wall=9.0).as_dict()
    assert list(line) == SCHEMA + ["lost_work"]
    assert line == {"round": 5, "time": previous["time"], "wall": previous["wall"],
                    "loss": None, "accuracy": None, "bytes_sent": previous["bytes_sent"],
                    "bytes_recv": previous["bytes_recv"], "compute_s": None, "delay_s": None,
                    "comm_s": None, "wait_s": None, "minibatches": 0, "samples": 0,
                    "consensus": None, "avg_accuracy": None, "lost_peers": {},
                    "lost_work": True}
    first = Record.of_lost_work(0, previous={}, bytes_counted=(1, 2), lost_peers={3: 0},
                                wall=9.0)
    assert (first.time, first.wall, first.bytes_sent, first.bytes_recv) == (0.0, 9.0, 1, 2)


def test_lines_before_the_rejoin_round_fill_unrecorded_rounds_with_lost_work():
    history = [record(r).as_dict() for r in (0, 1, 3, 4, 5)]  # round 2 never recorded
    history.append({"round": "garbage"})
    lines = lines_before(4, history, bytes_counted=(0, 0), lost_peers={}, wall=0.0)
    assert [line["round"] for line in lines] == [0, 1, 2, 3]
    assert lines[0] is history[0] and lines[3] is history[2]  # the killed process's, as read
    assert lines[2]["lost_work"] is True and lines[2]["bytes_sent"] == history[1]["bytes_sent"]
    assert not any("lost_work" in line for line in lines[:2] + lines[3:])
    assert lines_before(0, history, bytes_counted=(0, 0), lost_peers={}, wall=0.0) == []
