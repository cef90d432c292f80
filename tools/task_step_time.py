"""Seconds per training step (forward, backward, SGD step) of a built-in task's model on one
device: the compute a simulation states per step (experiments/workloads-sim.yaml).

    python tools/task_step_time.py resnet --option width=1.0 --option size=32 --batch 128
    python tools/task_step_time.py gpt --option size=full --batch 16 --bf16

Prints the median of ``--steps`` timed steps after ``--warmup`` untimed ones, on CUDA when
there is a GPU (synchronized around each step), else on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gossip.cli.common import key_values
from gossip.tasks import create_task


def step_seconds(task, batch: int, *, device: str, steps: int, warmup: int,
                 bf16: bool) -> float:
    torch.manual_seed(0)
    model = task.build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    reps = -(-batch // len(task.train))  # a task smaller than the batch: repeat it
    x = task.train.x.repeat(reps, *[1] * (task.train.x.dim() - 1))[:batch].to(device)
    y = task.train.y.repeat(reps, *[1] * (task.train.y.dim() - 1))[:batch].to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = task.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    args = parser.parse_args()
    task = create_task(args.task, seed=0, **key_values("--option", {}, args.option))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seconds = step_seconds(task, args.batch, device=device, steps=args.steps,
                           warmup=args.warmup, bf16=args.bf16)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    params = sum(p.numel() for p in task.build_model().parameters())
    print(f"{args.task} {args.option} batch {args.batch}{' bf16' if args.bf16 else ''}: "
          f"{params:,} parameters, {seconds * 1e3:.2f} ms per step on {name}")


if __name__ == "__main__":
    main()
