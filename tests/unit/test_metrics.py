"""Tests for gossip.metrics: JSONL writer/readers and Stopwatch."""

import json
import math
import threading

import numpy as np
import pytest

from gossip.errors import ConfigError
from gossip.metrics import MetricsWriter, Stopwatch, last_record, read_jsonl


def _record(i):
    return {
        "round": i,
        "time": 0.5 * i,
        "loss": 1.0 / (i + 1),
        "accuracy": 0.1 * (i % 10),
        "bytes_sent": 1000 * i,
        "bytes_recv": 999 * i,
        "compute_s": 0.01,
        "comm_s": 0.002,
        "wait_s": 0.0,
    }


def test_roundtrip(tmp_path):
    path = tmp_path / "deep" / "dir" / "peer0.jsonl"
    records = [_record(i) for i in range(5)]
    with MetricsWriter(path) as w:
        for r in records:
            w.write(r)
        # Flushed per line: readable while the writer is still open.
        assert read_jsonl(path) == records
    assert w.closed
    w.close()  # idempotent
    assert read_jsonl(path) == records
    assert last_record(path) == records[-1]
    assert path.read_text().count("\n") == 5


def test_truncates(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write({"round": 0})
    with MetricsWriter(path) as w:
        w.write({"round": 1})
    assert read_jsonl(path) == [{"round": 1}]


def test_nan_and_numpy_values(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write({"loss": float("nan"), "acc": np.float32(0.5), "n": np.int64(3),
                 "inf": math.inf, "v": np.array([1.0, np.nan]), "nested": {"x": float("nan")}})
    rec = read_jsonl(path)[0]
    assert rec == {
        "loss": None, "acc": 0.5, "n": 3, "inf": None, "v": [1.0, None], "nested": {"x": None}
    }
    assert "NaN" not in path.read_text()
    with MetricsWriter(path) as w, pytest.raises(TypeError):
        w.write({"bad": object()})


def test_float_precision_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    value = 0.1 + 0.2
    with MetricsWriter(path) as w:
        w.write({"x": value})
    assert read_jsonl(path)[0]["x"] == value


def test_partial_trailing_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write(_record(0))
        w.write(_record(1))
    full = json.dumps(_record(2)).encode()
    with open(path, "ab") as f:
        f.write(full[: len(full) // 2])  # writer killed mid-line
    assert read_jsonl(path) == [_record(0), _record(1)]
    assert last_record(path) == _record(1)


def test_unterminated_complete_line_is_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"round": 0}\n{"round": 1}')
    assert read_jsonl(path) == [{"round": 0}, {"round": 1}]
    assert last_record(path) == {"round": 1}


def test_partial_multibyte_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"round": 0}\n{"name": "\xc3')
    assert read_jsonl(path) == [{"round": 0}]
    assert last_record(path) == {"round": 0}


def test_corrupt_middle_line_raises(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"round": 0}\n{"rou\n{"round": 2}\n')
    with pytest.raises(ConfigError, match=":2"):
        read_jsonl(path)


def test_last_record_empty_and_missing(tmp_path):
    assert last_record(tmp_path / "missing.jsonl") is None
    path = tmp_path / "m.jsonl"
    MetricsWriter(path).close()
    assert last_record(path) is None
    assert read_jsonl(path) == []
    path.write_text('{"round": 0')  # only a partial line
    assert last_record(path) is None


def test_last_record_large_file(tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    with MetricsWriter(path) as w:
        for i in range(20000):
            w.write(_record(i))
    assert path.stat().st_size > 1_000_000

    # Count bytes actually read to show only the tail is touched.
    import builtins

    real_open = builtins.open
    read_bytes = []

    class Counting:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            read_bytes.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(builtins, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    assert last_record(path) == _record(19999)
    assert sum(read_bytes) < 10_000


def test_last_record_line_longer_than_block(tmp_path):
    path = tmp_path / "m.jsonl"
    long = {"round": 1, "blob": "x" * 20000}
    with MetricsWriter(path) as w:
        w.write({"round": 0})
        w.write(long)
    assert last_record(path, block=64) == long
    with open(path, "a") as f:
        f.write('{"round": 2, "blob": "' + "y" * 10000)  # long partial tail
    assert last_record(path, block=64) == long


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_stopwatch_totals_and_take():
    clock = FakeClock()
    sw = Stopwatch(clock)
    with sw("compute"):
        clock.now += 2.0
    with sw("comm"):
        clock.now += 0.5
    with sw("compute"):
        clock.now += 1.0
    assert sw.totals() == {"compute": 3.0, "comm": 0.5}
    assert sw.take() == {"compute": 3.0, "comm": 0.5}
    with sw("comm"):
        clock.now += 0.25
    # Names seen before appear with 0.0 so per-round records keep stable keys.
    assert sw.take() == {"compute": 0.0, "comm": 0.25}
    assert sw.take() == {"compute": 0.0, "comm": 0.0}
    assert sw.totals() == {"compute": 3.0, "comm": 0.75}
    sw.add("wait", 1.5)
    assert sw.take()["wait"] == 1.5


def test_stopwatch_counts_time_when_block_raises():
    clock = FakeClock()
    sw = Stopwatch(clock)
    with pytest.raises(RuntimeError), sw("compute"):
        clock.now += 1.0
        raise RuntimeError
    assert sw.totals() == {"compute": 1.0}


def test_stopwatch_real_clock_and_threads():
    sw = Stopwatch()
    def work():
        for _ in range(1000):
            sw.add("x", 0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sw.totals()["x"] == pytest.approx(4.0)
    with sw("real"):
        pass
    assert sw.totals()["real"] >= 0.0
