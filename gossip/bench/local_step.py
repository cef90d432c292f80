"""Our local step side by side with decentralizepy's, on the same model and mini-batches.

Ours is a ``Trainer``'s round without its record: ``compute`` (zero the gradients, draw the
batch, forward, loss, backward, ``loss.item()``) then ``synchronize`` (``Peer.step``: the flat
buffers and the optimizer step) on a peer alone, less the strategy's own ``synchronize`` (a
dpsgd peer without neighbours still scales and copies its model: that is the exchange's
part, not the step's). Theirs is
``decentralizepy.training.Training.trainstep`` (``model.zero_grad()``, forward, loss,
backward, ``optimizer.step()``, ``loss.item()``) on a copy of the same model, fed the same
batches (their own data loading is left out). The record (this round's test-set evaluation)
is timed on its own: it is bookkeeping decentralizepy does only when asked to test.

Times are CPU seconds of the process (``time.process_time``): on a shared machine the wall
clock mostly measures the scheduler. Blocks of steps alternate between the two; the verdict
is the median of per-block ratios.
decentralizepy is not a dependency: install it into its own environment (see
docs/PERFORMANCE.md) and run ``python -m gossip.bench.local_step`` there.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence

import torch

from gossip.errors import ConfigError


def _their_training(model: torch.nn.Module, loss_fn, lr: float, momentum: float):
    try:
        from decentralizepy.training.Training import Training
    except ImportError:
        raise ConfigError("decentralizepy is not installed in this environment (pip install "
                          "it from its source tree; docs/PERFORMANCE.md)") from None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return Training(0, 0, None, model, optimizer, loss_fn, "", batch_size=32)


def side_by_side(task: str = "deep-mlp", *, batch: int = 32, blocks: int = 7,
                 steps: int = 20, warmup: int = 10) -> dict[str, list[float]]:
    """Per block, the median seconds of one step: ours, theirs, and our record."""
    from gossip import Peer, Topology, TrainConfig
    from gossip.ports import free_ports
    from gossip.training.synchronous import Trainer

    config = TrainConfig(task=task, batch_size=batch, rounds=1 << 30, lr=0.05, momentum=0.9)
    # A port of its own: 7000, the default, may be another run's (or another test's).
    topology = Topology.generate("ring", 1, host="127.0.0.1").relocated(ports=free_ports(1))
    times: dict[str, list[float]] = {"ours": [], "theirs": [], "record": []}
    with Peer(0, topology, "dpsgd") as peer:
        trainer = Trainer(peer, config)
        exchange = _Timed(peer.strategy)
        theirs = _their_training(copy.deepcopy(trainer.model), trainer.task.loss_fn,
                                 config.lr, config.momentum)
        batches = [trainer.batches.next() for _ in range(steps)]
        round = 0

        def ours_block(n: int) -> tuple[list[float], list[float]]:
            nonlocal round
            step, record = [], []
            for _ in range(n):
                before, t0 = peer.stats, time.process_time()
                exchange.spent = 0.0
                work = trainer.compute(round)
                comm_s = trainer.synchronize(round, work)
                t1 = time.process_time()
                trainer.record(round, work, comm_s, before=before, after=peer.stats)
                step.append(t1 - t0 - exchange.spent)
                record.append(time.process_time() - t1)
                round += 1
            return step, record

        def theirs_block(n: int) -> list[float]:
            step = []
            for i in range(n):
                t0 = time.process_time()
                theirs.trainstep(*batches[i % len(batches)])
                step.append(time.process_time() - t0)
            return step

        ours_block(warmup)
        theirs_block(warmup)
        for b in range(blocks):
            for side in (("ours", "theirs") if b % 2 == 0 else ("theirs", "ours")):
                if side == "ours":
                    step, record = ours_block(steps)
                    times["ours"].append(statistics.median(step))
                    times["record"].append(statistics.median(record))
                else:
                    times["theirs"].append(statistics.median(theirs_block(steps)))
    return times


class _Timed:
    """Wraps a strategy's ``synchronize`` in place, adding its CPU seconds to ``spent``."""

    def __init__(self, strategy):
        self.spent, inner = 0.0, strategy.synchronize

        def synchronize(*args, **kwargs):
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += time.process_time() - start

        strategy.synchronize = synchronize


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="deep-mlp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as "
                        "gossip launch runs each peer)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    try:
        times = side_by_side(opts.task, batch=opts.batch, blocks=opts.blocks, steps=opts.steps)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    ratios = [o / t for o, t in zip(times["ours"], times["theirs"])]
    for name in ("ours", "theirs", "record"):
        print(f"{name:7s} ms per step, block medians: "
              + ", ".join(f"{v * 1e3:.2f}" for v in times[name])
              + f"  (median {statistics.median(times[name]) * 1e3:.2f})")
    print(f"ours / theirs, per block: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
