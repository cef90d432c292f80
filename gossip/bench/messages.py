"""The transport's CPU cost per message, beside a bare pyzmq floor.

Two ZmqTransport peers in two processes on this machine (ipc and, for frames of 64 KiB and
more, shared memory, as peers on one host use them), the loopback transport of the tests
(two threads of one process), and the same frames over a raw DEALER/ROUTER pair (ipc, no
header, no checks: the floor any ZeroMQ design pays). Messages carry a ~200-byte header
and 0, 1 or 3 tensor frames of 1 kB, 50 kB or 4 MB. Two patterns:

* ``stream``: one peer sends a burst, the other receives it; CPU per message of each side.
* ``pingpong``: one message each way in turn; CPU per exchange (a send and a receive) of
  each side.

CPU is counted two ways: the calling thread's (``time.thread_time``) and the process's
(``time.process_time``: also ZeroMQ's I/O thread and pyzmq's garbage-collector thread,
which move the bytes of a send after it returned). The loopback transport has no process
of its own: its column is the thread's.

``python -m gossip.bench.messages`` prints the table. ``--trees A,B`` runs this file once
per tree and run, alternating, with ``PYTHONPATH`` set to each (two checkouts: before and
after a change), and prints the medians side by side: the file uses only the transport's public
interface, so an older tree can be measured with it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # run as a file: this folder must not shadow top-level modules
    sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("gossip/bench")]

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import msgpack
import numpy as np
import torch
import zmq

from gossip.bench.harness import run_ranks
from gossip.ports import free_ports
from gossip.transport import Message
from gossip.transport.loopback import LoopbackHub
from gossip.transport.zmq import ZmqTransport

KIND = "bench"
SIZES = {"1k": 1 << 10, "50k": 50 << 10, "4M": 4 << 20}
# (frames, size): no tensor, then 1 and 3 frames of each size.
SHAPES = [(0, "1k")] + [(f, s) for s in SIZES for f in (1, 3)]
PATTERNS = ("stream", "pingpong")
# Messages per shape: about this many bytes, within these bounds.
BYTES_PER_SHAPE = 256 << 20
MIN_COUNT, MAX_COUNT = 40, 3000
WARMUP = 20


def count_for(frames: int, size: str, scale: float = 1.0) -> int:
    nbytes = max(frames * SIZES[size], 1)
    return int(max(MIN_COUNT, min(MAX_COUNT, BYTES_PER_SHAPE // nbytes)) * scale)


def parse_shape(text: str) -> tuple[int, str] | None:
    """``"3x50k"`` -> ``(3, "50k")``; None if it is not FRAMESxSIZE."""
    frames, _, size = text.partition("x")
    if not frames.isdigit() or not 0 <= int(frames) <= 64 or size not in SIZES:
        return None
    return int(frames), size


def _meta() -> dict:
    """A meta that makes the packed header about 200 bytes, like a sparse block's."""
    return {"n": 5_000_000, "s": 1, "b": [0, 1, 2], "k": [6250, 6250, 6250],
            "ix": ["gap8", "gap8", "gap8"], "nb": [7000, 7001, 7002], "pad": "x" * 40}


def _message(frames: int, size: str, round: int = 0) -> Message:
    n = SIZES[size] // 4
    buffers = tuple(torch.full((n,), float(i + 1)) for i in range(frames))
    return Message(kind=KIND, round=round, meta=_meta(), buffers=buffers)


def _clocks() -> tuple[float, float]:
    return time.thread_time(), time.process_time()


def _per(start: tuple[float, float], count: int) -> tuple[float, float]:
    thread, process = _clocks()
    return ((thread - start[0]) / count * 1e6, (process - start[1]) / count * 1e6)


# ------------------------------------------------------------------------------ the loops

def _time_patterns(rank: int, channel, shapes, patterns, scale) -> dict:
    """Rank 0 sends a stream and starts each exchange; rank 1 receives and answers.
    ``channel(frames, size)`` gives the shape's ``(block, send, recv, ack)``: ``block()``
    readies the next block of messages (untimed), the others move one message each.
    Returns {"pattern/FxS": (thread µs, process µs)} of this side."""
    out = {}
    for frames, size in shapes:
        block, send, recv, ack = channel(frames, size)
        count = count_for(frames, size, scale)
        for pattern in patterns:
            for timed in (False, True):
                n = count if timed else WARMUP
                block()
                start = _clocks()
                if pattern == "stream":
                    if rank == 0:
                        for _ in range(n):
                            send()
                        recv()  # the receiver's ack
                    else:
                        for _ in range(n):
                            recv()
                        per = _per(start, n)
                        ack()
                else:
                    for _ in range(n):
                        if rank == 0:
                            send()
                            recv()
                        else:
                            recv()
                            send()
                if rank == 0 or pattern == "pingpong":
                    per = _per(start, n)
                if timed:
                    out[f"{pattern}/{frames}x{size}"] = per
    return out


def _transport_channel(rank: int, transport):
    """``_time_patterns``' channel over a gossip transport: each block a round of its own."""
    peer, state = 1 - rank, {"round": 0, "msg": None}

    def channel(frames, size):
        shaped = _message(frames, size)

        def block():
            state["round"] += 1
            state["msg"] = Message(kind=KIND, round=state["round"], meta=shaped.meta,
                                   buffers=shaped.buffers)

        return (block, lambda: transport.send(peer, state["msg"]),
                lambda: transport.recv(src=peer, kind=KIND, round=state["round"]),
                lambda: transport.send(peer, Message(kind=KIND, round=state["round"])))
    return channel


def _zmq_rank(rank: int, world: int, ports: list[int], shapes, patterns, scale) -> dict:
    torch.set_num_threads(1)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    with ZmqTransport(rank, endpoints, kinds=[KIND]) as transport:
        transport.connect([1 - rank])
        result = _time_patterns(rank, _transport_channel(rank, transport), shapes, patterns,
                                scale)
        transport.shutdown()
    return result


def _loopback(shapes, patterns, scale) -> dict[int, dict]:
    hub = LoopbackHub(2)
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def side(rank):
        try:
            channel = _transport_channel(rank, hub.transport(rank, kinds=[KIND]))
            results[rank] = _time_patterns(rank, channel, shapes, patterns, scale)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------ the pyzmq floor

def _pyzmq_rank(rank: int, world: int, path: str, shapes, patterns, scale) -> dict:
    """The same frames over a DEALER (rank 0) and a ROUTER (rank 1) on ipc: copied below
    64 KiB, zero-copy above, as the transport sends them; received without a copy."""
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER if rank == 0 else zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    if rank == 1:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    route: list = []
    if rank == 0:
        sock.connect(f"ipc://{path}")
        sock.send(b"hello")
    else:
        sock.bind(f"ipc://{path}")
        route = [sock.recv_multipart()[0]]
    header = msgpack.packb({"v": 1, "kind": KIND, "round": 0, "src": rank, "meta": _meta(),
                            "tensors": []}, use_bin_type=True)

    def channel(frames, size):
        arrays = [np.full(SIZES[size] // 4, i + 1, dtype=np.float32) for i in range(frames)]
        parts = route + [header] + [a if a.nbytes >= 64 << 10 else a.tobytes() for a in arrays]
        return (lambda: None, lambda: sock.send_multipart(parts, copy=False),
                lambda: sock.recv_multipart(copy=False),
                lambda: sock.send_multipart(route + [b"ack"]))

    try:
        return _time_patterns(rank, channel, shapes, patterns, scale)
    finally:
        sock.close(linger=2000)  # the last reply may still be on its way
        ctx.term()


# ----------------------------------------------------------------------------- the table

def measure(shapes=SHAPES, patterns=PATTERNS, scale: float = 1.0,
            transports=("zmq", "loopback", "pyzmq")) -> dict:
    """{transport: {rank: {"pattern/FxS": (thread µs, process µs)}}}."""
    results = {}
    if "zmq" in transports:
        ports = free_ports(2)
        results["zmq"] = dict(enumerate(run_ranks(_zmq_rank, 2, ports, shapes, patterns,
                                                  scale, timeout=900)))
    if "loopback" in transports:
        results["loopback"] = _loopback(shapes, patterns, scale)
    if "pyzmq" in transports:
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gossip-bench-{os.getpid()}")
        results["pyzmq"] = dict(enumerate(run_ranks(_pyzmq_rank, 2, path, shapes, patterns,
                                                    scale, timeout=900)))
    return results


def rows(results: dict) -> list[tuple]:
    """(transport, pattern, shape, side, thread µs, process µs) per measurement. Sides:
    stream: send (rank 0), recv (rank 1); pingpong: a (rank 0), b (rank 1)."""
    out = []
    for name, ranks in results.items():
        for key in ranks[0]:
            pattern, shape = key.split("/")
            sides = ("send", "recv") if pattern == "stream" else ("a", "b")
            for rank, side in enumerate(sides):
                thread, process = ranks[rank][key]
                out.append((name, pattern, shape, side, thread, process))
    return out


def _print_single(results: dict) -> None:
    print(f"{'transport':9} {'pattern':8} {'shape':6} {'side':4} {'thread µs':>10} "
          f"{'process µs':>10}")
    for name, pattern, shape, side, thread, process in rows(results):
        print(f"{name:9} {pattern:8} {shape:6} {side:4} {thread:10.1f} {process:10.1f}")


def _compare(trees: list[str], runs: int, argv: list[str]) -> None:
    """Run this file under each tree in turn, ``runs`` times, and print the medians."""
    collected: dict[str, list] = {tree: [] for tree in trees}
    for run in range(runs):
        for tree in (trees if run % 2 == 0 else trees[::-1]):
            env = {**os.environ, "PYTHONPATH": tree}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", *argv],
                                  env=env, cwd="/tmp", capture_output=True, text=True,
                                  check=False)
            if proc.returncode:
                raise SystemExit(f"{tree}: {proc.stderr[-3000:]}")
            collected[tree].append(rows(_from_json(proc.stdout)))
    medians = {}
    for tree, runs_rows in collected.items():
        for row_set in zip(*runs_rows):
            key = row_set[0][:4]
            medians.setdefault(key, {})[tree] = (
                statistics.median(r[4] for r in row_set), statistics.median(r[5] for r in row_set))
    names = [os.path.basename(t.rstrip("/")) or t for t in trees]
    head = " ".join(f"{n[:12] + ' thr':>16} {n[:12] + ' proc':>17}" for n in names)
    print(f"medians of {runs} runs, CPU µs per message (pingpong: per exchange)")
    print(f"{'transport':9} {'pattern':8} {'shape':6} {'side':4} {head}")
    for key, by_tree in medians.items():
        cells = " ".join(f"{by_tree[t][0]:16.1f} {by_tree[t][1]:17.1f}" for t in trees)
        print(f"{key[0]:9} {key[1]:8} {key[2]:6} {key[3]:4} {cells}")


def _from_json(text: str) -> dict:
    raw = json.loads(text.strip().splitlines()[-1])
    return {name: {int(rank): {k: tuple(v) for k, v in per.items()}
                   for rank, per in ranks.items()} for name, ranks in raw.items()}


def without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less ``options`` and their values (``--name value`` or ``--name=value``)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in options:
            skip = True
        elif not word.startswith(tuple(f"{o}=" for o in options)):
            out.append(word)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="zmq,loopback,pyzmq",
                        help="comma-separated: zmq, loopback, pyzmq")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--shapes", default=None,
                        help="comma-separated FRAMESxSIZE (e.g. 0x1k,1x50k,3x4M); default all")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies message counts")
    parser.add_argument("--trees", default=None,
                        help="comma-separated source trees to compare (PYTHONPATH of each run)")
    parser.add_argument("--runs", type=int, default=3, help="runs per tree with --trees")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    if args.trees:
        _compare(args.trees.split(","), args.runs,
                 without_options(sys.argv[1:] if argv is None else argv, ("--trees", "--runs")))
        return
    shapes = SHAPES
    if args.shapes is not None:
        shapes = [parse_shape(text) for text in args.shapes.split(",")]
        if None in shapes:
            parser.error(f"--shapes {args.shapes!r}: each must be FRAMESxSIZE with FRAMES 0-64 "
                         f"and SIZE one of {', '.join(SIZES)}")
    results = measure(shapes, tuple(args.patterns.split(",")), args.scale,
                      tuple(args.transports.split(",")))
    if args.json:
        print(json.dumps({name: {rank: {k: list(v) for k, v in per.items()}
                                 for rank, per in ranks.items()}
                          for name, ranks in results.items()}))
    else:
        _print_single(results)


if __name__ == "__main__":
    main()
