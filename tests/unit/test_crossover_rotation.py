"""The crossover schedule and the in-process arbiter: jobs as threads whose rounds are a
compute phase (slept under the device lock) and a communication phase (slept outside)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from gossip.crossover import LocalArbiter
from gossip.crossover.grants import overlaps, read_grants, turn_breaks
from gossip.crossover.rotation import Request, Rotation
from gossip.errors import ConfigError, PeerTimeout

C, M = 0.03, 0.03


def fake_jobs(arbiter, rounds: dict[str, int], *, devices=("d0", "d1"), compute=C, comm=M,
              waits: dict | None = None):
    """Each job runs one rank per device; returns every rank's round end times (and puts
    each round's wait for the device into ``waits`` if given)."""
    ends: dict[tuple[str, str], list[float]] = {}
    waits = {} if waits is None else waits
    errors = []

    def rank_main(job, rank, device):
        try:
            with arbiter.lock(device, job, rank, timeout=10) as lock:
                times = ends.setdefault((job, device), [])
                for round in range(rounds[job]):
                    with lock.compute(round) as hold:
                        lock.sleep(compute)
                    waits.setdefault((job, device), []).append(hold.wait_s)
                    time.sleep(comm)
                    times.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(job, rank, device))
               for job in rounds for rank, device in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return ends


def test_grants_never_overlap_and_alternate(tmp_path):
    arbiter = LocalArbiter(grant_log=tmp_path / "grants.jsonl")
    fake_jobs(arbiter, {"a": 6, "b": 6})
    grants = read_grants(tmp_path / "grants.jsonl")
    assert len(grants) == 24
    assert overlaps(grants) == []
    assert turn_breaks(grants, ["a", "b"]) == 0
    for device in ("d0", "d1"):
        order = [g["job"] for g in sorted(grants, key=lambda g: g["t_grant"])
                 if g["device"] == device]
        assert order == ["a", "b"] * 6  # the lowest job first, on every device


def test_a_finished_job_frees_the_rotation(tmp_path):
    arbiter = LocalArbiter(grant_log=tmp_path / "grants.jsonl")
    waits: dict = {}
    fake_jobs(arbiter, {"a": 2, "b": 10}, waits=waits)
    # Alone, b gets the device as it asks: no turn kept for the job that left (which would
    # cost it a wait of C or more, or hang). The bound is only a thread wake-up's jitter.
    alone = sorted(waits["b", "d0"][5:])
    assert alone[len(alone) // 2] < 0.5 * C, alone
    assert overlaps(read_grants(tmp_path / "grants.jsonl")) == []


def test_timeout_names_the_device_and_the_holder():
    arbiter = LocalArbiter()
    with arbiter.lock("gpu0", "a", 3) as a, arbiter.lock("gpu0", "b", 1, timeout=0.05) as b:
        with a.compute(7):
            with pytest.raises(PeerTimeout, match="device gpu0: job b rank 1 .* held by job a "
                                                  r"rank 3 \(round 7\)"):
                with b.compute(0):
                    pass


def test_a_grant_held_too_long_is_revoked(tmp_path, caplog):
    arbiter = LocalArbiter(max_hold_s=0.05, grant_log=tmp_path / "grants.jsonl")
    with arbiter.lock("gpu0", "a", 0) as a, arbiter.lock("gpu0", "b", 0, timeout=2) as b:
        with a.compute(0):
            with b.compute(0) as hold:  # a never releases in time: b gets it
                pass
    assert "revoked job a rank 0's grant of round 0" in caplog.text
    grants = read_grants(tmp_path / "grants.jsonl")
    assert [g.get("revoked") is not None for g in grants] == [True, False]
    # b got the device max_hold_s after a did (b's own wait is shorter when its request
    # came late), and not before a's grant was revoked.
    assert grants[1]["t_grant"] - grants[0]["t_grant"] >= 0.05 and hold.wait_s > 0


def test_patience_zero_is_first_come_first_served():
    rotation = Rotation("d", patience_s=0)
    rotation.join("a", 0)
    rotation.request(Request("b", 0, 0, t_request=1.0))
    assert rotation.next_grant(1.0).job == "b"  # a's turn, but a is not asking
    strict = Rotation("d", patience_s=math.inf)
    strict.join("a", 0)
    strict.request(Request("b", 0, 0, t_request=1.0))
    assert strict.next_grant(1.0) is None and strict.wake_at() == math.inf
    patient = Rotation("d", patience_s=0.5)
    patient.join("a", 0)
    patient.request(Request("b", 0, 0, t_request=1.0))
    assert patient.next_grant(0.2) is None and patient.next_grant(0.6).job == "b"


def test_a_job_joining_after_another_jobs_turn_goes_next():
    # Job a alone took round 0 on this device; b joins late (its peer started later).
    # Strict alternation puts b next, as on the devices where both were there from the
    # start, rather than a again (then this device would stay a turn behind all run long).
    rotation = Rotation("d")
    rotation.request(Request("a", 0, 0, t_request=0.0))
    assert rotation.next_grant(0.0).job == "a"
    rotation.release("a", 0, 0.1)
    rotation.join("b", 0)
    rotation.request(Request("b", 0, 0, t_request=0.2))
    assert rotation.next_grant(0.2).job == "b"
    rotation.request(Request("a", 0, 1, t_request=0.3))
    assert rotation.next_grant(0.3) is None  # b holds it
    rotation.release("b", 0, 0.4)
    assert rotation.next_grant(0.4).job == "a"
    late = Rotation("d")  # b joins while a holds the device: b is next, as before
    late.request(Request("a", 0, 0, t_request=0.0))
    late.next_grant(0.0)
    late.request(Request("b", 0, 0, t_request=0.05))
    late.release("a", 0, 0.1)
    assert late.next_grant(0.1).job == "b"


def test_a_waiter_that_gave_up_is_never_granted_and_a_racing_grant_is_released():
    # b timed out waiting while a held the device: when a releases, nobody is granted
    # (before, b's dead request took the device until b said goodbye or its lease ran out).
    rotation = Rotation("d")
    rotation.request(Request("a", 0, 0, t_request=0.0))
    rotation.next_grant(0.0)
    rotation.request(Request("b", 0, 0, t_request=0.1))
    assert rotation.withdraw("b", 0, 0.3) is None
    rotation.release("a", 0, 0.4)
    assert rotation.next_grant(0.4) is None and not rotation.waiting
    # The grant came just before the withdraw: it is released (and logged) at once.
    rotation.request(Request("b", 0, 1, t_request=0.5))
    assert rotation.next_grant(0.5).job == "b"
    done = rotation.withdraw("b", 0, 0.6)
    assert (done.job, done.t_release) == ("b", 0.6) and rotation.holder is None


def test_three_jobs_each_see_the_grant_another_thread_made_for_them(tmp_path):
    # A release wakes every waiter; the first one up grants the device to the job whose
    # turn it is, often another thread's. That thread must notice it holds the device (it
    # slept through its whole timeout, then named itself the holder).
    arbiter = LocalArbiter(grant_log=tmp_path / "grants.jsonl")
    fake_jobs(arbiter, {"a": 20, "b": 20, "c": 20}, devices=("d0",), compute=0.001, comm=0.001)
    grants = read_grants(tmp_path / "grants.jsonl")
    assert sorted(g["job"] for g in grants) == ["a"] * 20 + ["b"] * 20 + ["c"] * 20
    assert overlaps(grants) == [] and turn_breaks(grants, ["a", "b", "c"]) == 0


def test_ranks_of_one_job_on_one_device_take_turns(tmp_path):
    # Ranks 0 and 1 of jobs a and b all on d0: each rank is served, in turn (before, one
    # request per job and device: rank 1 was never granted).
    arbiter = LocalArbiter(grant_log=tmp_path / "grants.jsonl")
    fake_jobs(arbiter, {"a": 3, "b": 3}, devices=("d0", "d0"), compute=0.001, comm=0.001)
    grants = sorted(read_grants(tmp_path / "grants.jsonl"), key=lambda g: g["t_grant"])
    order = [(g["job"], g["rank"]) for g in grants]
    assert len(order) == 12 and overlaps(grants) == []
    assert sorted(order.count(m) for m in set(order)) == [3, 3, 3, 3], order
    # Turns go round: between two turns of one rank, every rank that was waiting when the
    # first ended was served. (Strict alternation, the other three between two turns of one,
    # also needs each rank to ask again before the others' turns end: a thread scheduled
    # late on a loaded machine misses its place in the cycle, and the next one takes it.)
    def member(g):
        return g["job"], g["rank"]

    for first in grants:
        again = next((g for g in grants if member(g) == member(first)
                      and g["t_grant"] > first["t_grant"]), None)
        if again is None:
            continue
        waiting = [g for g in grants if member(g) != member(first)
                   and g["t_request"] <= first["t_release"] < g["t_grant"]]
        assert all(g["t_grant"] < again["t_grant"] for g in waiting), order


def test_a_revoked_holder_waits_again_before_more_device_time(tmp_path):
    # Revoked, a went on sleeping its device time while b computed too.
    arbiter = LocalArbiter(max_hold_s=0.1, grant_log=tmp_path / "grants.jsonl")
    spans, errors, a_granted = {}, [], threading.Event()

    def b_main(b):
        try:
            a_granted.wait(10)
            with b.compute(0):
                start = time.time()
                b.sleep(0.05)
                spans["b"] = (start, time.time())
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    with arbiter.lock("gpu0", "a", 0, timeout=10) as a, \
            arbiter.lock("gpu0", "b", 0, timeout=10) as b:
        thread = threading.Thread(target=b_main, args=(b,))
        thread.start()
        with a.compute(0):
            a_granted.set()
            start = time.time()
            a.sleep(0.5)
            spans["a"] = (start, time.time())
        thread.join(timeout=30)
    assert not errors, errors
    grants = sorted(read_grants(tmp_path / "grants.jsonl"), key=lambda g: g["t_grant"])
    assert [(g["job"], "revoked" in g) for g in grants] == [("a", True), ("b", False),
                                                           ("a", False)]
    assert grants[2]["t_grant"] >= grants[1]["t_release"]
    # each one's device time under its own grants (a's but for the moment it takes to learn)
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    assert (grants[0]["t_release"] - a0) + (a1 - grants[2]["t_grant"]) >= 0.35
    assert grants[1]["t_grant"] <= b0 and b1 <= grants[1]["t_release"]


def test_a_lone_holder_is_not_revoked():
    rotation = Rotation("d")
    rotation.request(Request("a", 0, 0, t_request=0.0))
    rotation.next_grant(0.0)
    assert rotation.expire(10.0, max_hold_s=1.0) is None  # nobody else wants the device
    rotation.request(Request("b", 0, 0, t_request=10.0))
    assert rotation.expire(10.0, max_hold_s=1.0).revoked == "held past max_hold_s=1.0"


@pytest.mark.parametrize("options, culprit", [
    ({"max_hold_s": 0}, "max_hold_s 0"), ({"max_hold_s": math.nan}, "max_hold_s nan"),
    ({"patience_s": -1}, "patience_s -1"),
])
def test_an_arbiter_refuses_limits_that_cannot_work(options, culprit):
    # max_hold_s=0 was accepted: every grant revoked as it was made.
    with pytest.raises(ConfigError, match=culprit):
        LocalArbiter(**options)
