"""Run one function in ``world`` spawned processes and collect the results.

This is the launcher the benchmark baselines use. It is deliberately small: each rank
is a ``spawn`` process (no inherited sockets, threads or CUDA/OpenMP state from the
parent), results travel back through one ``multiprocessing.Queue``, and every exit
path -- success, an exception in a rank, a rank that dies silently, a timeout, or an
interrupt in the parent -- terminates and reaps every child.
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from typing import Any

from gossip.errors import BenchmarkFailed, ConfigError

#: Thread caps applied to every rank unless the caller overrides them. The benchmark
#: machines have few cores shared by ``world`` processes; letting each rank start one
#: OpenMP/MKL thread per core oversubscribes them and makes timings noisy.
DEFAULT_ENV: Mapping[str, str] = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# How long a terminated rank gets to exit before it is killed.
_TERMINATE_GRACE_S = 2.0
# How often the parent wakes up to check for ranks that died without reporting.
_POLL_S = 0.1


def run_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str | None] | None = None,
) -> list[Any]:
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes.

    Args:
        target: A module-level (picklable) function. Its return value must be
            picklable; it is sent back to the parent.
        world: Number of processes (ranks ``0 .. world-1``).
        *args: Extra positional arguments passed to every rank. They are pickled, so
            multiprocessing primitives must come from the ``spawn`` context.
        timeout: Seconds the whole run may take, counted from the first start.
        env: Environment variables for the ranks, applied on top of
            :data:`DEFAULT_ENV` (so callers can override the thread caps); None unsets
            one (e.g. ``OMP_NUM_THREADS: None`` leaves torch its default threads).

    Returns:
        The ranks' return values, ordered by rank.

    Raises:
        ConfigError: If ``world < 1``.
        BenchmarkFailed: If a rank raises (the message names the rank; its first line is
            the exception summary and the later lines carry the rank's traceback), a
            rank exits without reporting, or the timeout passes. The remaining ranks
            are terminated (killed after 2 s) before the error is raised.
    """
    if world < 1:
        raise ConfigError(f"world must be >= 1, got {world}")
    child_env = {**DEFAULT_ENV, **(env or {})}
    ctx = get_context("spawn")
    results_q = ctx.Queue()
    procs: list[BaseProcess] = [
        ctx.Process(
            target=_rank_main,
            args=(results_q, target, rank, world, args, child_env),
            name=f"rank-{rank}",
            daemon=True,  # a crashing parent must not leave ranks behind
        )
        for rank in range(world)
    ]
    try:
        # The variables must be in the environment the child is *exec'ed* with:
        # unpickling ``target`` in the child imports its module (and often torch) before
        # any of our code runs there, and OpenMP reads OMP_NUM_THREADS when it loads.
        with _patched_environ(child_env):
            for proc in procs:
                proc.start()
        return _collect(procs, results_q, world, timeout)
    finally:
        _stop_all(procs)
        results_q.close()
        # The parent never puts, but do not let interpreter exit wait on the queue.
        results_q.cancel_join_thread()


def _collect(
    procs: Sequence[BaseProcess], results_q: Any, world: int, timeout: float
) -> list[Any]:
    """Wait for one report per rank; raise on the first failure or on timeout."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while len(results) < world:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = ", ".join(str(r) for r in range(world) if r not in results)
            raise BenchmarkFailed(f"rank(s) {missing} did not finish within {timeout:g} s")
        try:
            report = results_q.get(timeout=min(_POLL_S, remaining))
        except queue.Empty:
            _check_silent_deaths(procs, results_q, results)
            continue
        _record(report, results)
    return [results[r] for r in range(world)]


def _record(report: tuple, results: dict[int, Any]) -> None:
    """Store a successful report or raise the rank's failure."""
    rank, ok, payload = report
    if ok:
        results[rank] = payload
        return
    summary, tb_text = payload
    raise BenchmarkFailed(f"rank {rank} failed: {summary}\n{tb_text}".rstrip())


def _check_silent_deaths(
    procs: Sequence[BaseProcess], results_q: Any, results: dict[int, Any]
) -> None:
    """Raise if a rank exited without a report (killed, segfault, ``os._exit``)."""
    dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
    if not dead:
        return
    # A rank flushes its report before it exits, so anything it sent is already in
    # the pipe; drain it before concluding that the rank died silently.
    while True:
        try:
            _record(results_q.get(timeout=_POLL_S), results)
        except queue.Empty:
            break
    for rank in dead:
        if rank not in results:
            code = procs[rank].exitcode
            raise BenchmarkFailed(f"rank {rank} exited with code {code} without reporting a result")


def _stop_all(procs: Sequence[BaseProcess]) -> None:
    """Terminate, then kill, then reap every started process (no zombies)."""
    started = [p for p in procs if p.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.is_alive():
            proc.kill()
            proc.join()
    for proc in started:
        proc.close()


@contextmanager
def _patched_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Temporarily set ``values`` in ``os.environ`` (None: unset) and restore it afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    _apply_environ(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _apply_environ(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _rank_main(
    results_q: Any,
    target: Callable[..., Any],
    rank: int,
    world: int,
    args: tuple,
    env: Mapping[str, str],
) -> None:
    """Child entry point: apply the thread caps, run the target, report back."""
    try:
        _apply_environ(env)
        _cap_torch_threads(env)
        result = target(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 -- SystemExit etc. must be reported too
        summary = f"{type(exc).__name__}: {exc}"
        results_q.put((rank, False, (summary, traceback.format_exc())))
    else:
        results_q.put((rank, True, result))
    # Process exit joins the queue's feeder thread, so the report is flushed first.


def _cap_torch_threads(env: Mapping[str, str]) -> None:
    """Match torch's intra-op pool to OMP_NUM_THREADS if torch is loaded.

    Torch is only touched when the target's module already imported it: a target that
    imports torch later reads OMP_NUM_THREADS from the environment at that point, and
    torch-free targets should not pay a second of import time per rank.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        threads = int(env.get("OMP_NUM_THREADS") or 0)
    except ValueError:
        return
    if threads > 0:
        torch.set_num_threads(threads)


def summarize(times: Sequence[float]) -> dict:
    """Summary statistics of a list of durations.

    Args:
        times: Durations in seconds; must not be empty.

    Returns:
        ``{"median", "min", "max"}`` in seconds and ``"n"``, the number of samples.

    Raises:
        ConfigError: If ``times`` is empty.
    """
    if not times:
        raise ConfigError("summarize() needs at least one time")
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "n": len(times),
    }


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Render ``rows`` as a plain aligned text table.

    Numbers are right-aligned (floats with 4 significant digits), everything else is
    left-aligned; a key missing from a row renders as an empty cell.

    Args:
        rows: One dict per table row.
        columns: Keys to show, in order; they are also the header.

    Returns:
        The table as a string: header, a dashed rule, then one line per row.
    """
    cells = [[_format_cell(row.get(col, "")) for col in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(col), (int, float)) for row in rows if col in row)
        for col in columns
    ]
    widths = [
        max([len(col)] + [len(line[i]) for line in cells]) for i, col in enumerate(columns)
    ]

    def render(values: Sequence[str]) -> str:
        parts = [
            val.rjust(w) if num else val.ljust(w)
            for val, w, num in zip(values, widths, numeric)
        ]
        return "  ".join(parts).rstrip()

    lines = [render(columns), "  ".join("-" * w for w in widths)]
    lines.extend(render(line) for line in cells)
    return "\n".join(lines)


def _format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
