"""The leak check every test passes through (tests/support/leaks.py) must see each kind of
leak, name it, and clean up what it safely can; and must not cry wolf."""

from __future__ import annotations

import subprocess
import sys
import threading

import zmq

from support.leaks import Leaks, children


def test_nothing_left_behind_is_no_leak():
    before = Leaks.start()
    done = threading.Thread(target=lambda: None, name="short-lived")
    done.start()
    ctx = zmq.Context()
    ctx.socket(zmq.PUSH).close()
    ctx.term()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert before.check(grace=1.0) is None


def test_a_thread_still_running_is_named():
    before = Leaks.start()
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="stuck-worker", daemon=True)
    stuck.start()
    try:
        assert before.check(grace=0.05) == "1 thread(s) still running: stuck-worker"
    finally:
        release.set()
        stuck.join(5)


def test_a_context_not_terminated_is_counted_and_destroyed():
    before = Leaks.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    problem = before.check(grace=0.05)
    assert problem.startswith("1 ZeroMQ context(s) not terminated: <zmq.Context(1 socket)")
    assert ctx.closed and sock.closed


def test_a_child_still_running_is_named_and_killed():
    before = Leaks.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        problem = before.check(grace=0.05)
        assert problem == (f"1 child process(es) still running: pid {child.pid}: "
                           f"{sys.executable} -c import time; time.sleep(60)")
        assert child.pid not in children()  # killed and reaped
    finally:
        child.kill()
        child.wait()
