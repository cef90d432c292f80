"""The machine-wide cache of a task's arrays: built once, loaded after, never stale."""

from __future__ import annotations

import threading
import time

import numpy as np

from gossip.tasks.cache import cached_arrays


def test_arrays_are_built_once_and_loaded_equal_after(tmp_path, monkeypatch):
    monkeypatch.setenv("GOSSIP_CACHE", str(tmp_path))
    built = []

    def build():
        built.append(1)
        return {"x": np.arange(7, dtype=np.float32) / 3, "y": np.array([3, 1], dtype=np.int64)}

    first, second = cached_arrays("k1", build), cached_arrays("k1", build)
    assert len(built) == 1
    for name in ("x", "y"):
        assert second[name].dtype == first[name].dtype
        np.testing.assert_array_equal(second[name], first[name])
    cached_arrays("k2", build)  # another key is another file
    assert len(built) == 2


def test_a_broken_file_is_rebuilt_and_an_unwritable_directory_costs_only_the_build(
        tmp_path, monkeypatch):
    monkeypatch.setenv("GOSSIP_CACHE", str(tmp_path))
    (tmp_path / "k.npz").write_bytes(b"not an npz")
    assert cached_arrays("k", lambda: {"x": np.ones(2)})["x"].tolist() == [1.0, 1.0]
    assert np.load(tmp_path / "k.npz")["x"].tolist() == [1.0, 1.0]  # replaced
    (tmp_path / "a-file").write_text("")  # no directory can be made under it, even by root
    monkeypatch.setenv("GOSSIP_CACHE", str(tmp_path / "a-file" / "cache"))
    assert cached_arrays("k", lambda: {"x": np.zeros(1)})["x"].tolist() == [0.0]


def test_peers_in_threads_of_one_process_build_once_and_load_one_at_a_time(tmp_path, monkeypatch):
    """Threads asking at once: one builds, the others load its file, and no two are inside
    the cache together (np.load's header parse is not thread-safe on CPython 3.11)."""
    monkeypatch.setenv("GOSSIP_CACHE", str(tmp_path))
    built, inside, most_inside = [], [0], [0]

    def build():
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        time.sleep(0.1)  # long enough for every thread to arrive while the first builds
        built.append(1)
        inside[0] -= 1
        return {"x": np.arange(5.0)}

    threads = [threading.Thread(target=cached_arrays, args=("k", build)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)
    assert len(built) == 1 and most_inside[0] == 1
