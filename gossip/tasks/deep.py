"""The ``deep-mlp`` task: the bundled digits with an MLP whose width and depth are options,
big enough (1-25M parameters, 4-16 layers) for gradient buckets to overlap backward."""

from __future__ import annotations

import dataclasses

from torch import nn

from gossip.errors import ConfigError
from gossip.tasks.base import TASKS, Task
from gossip.tasks.digits import NUM_CLASSES, NUM_FEATURES, digits_task


def build_deep_mlp(width: int, depth: int) -> nn.Sequential:
    """``depth`` linear layers: 64 -> width -> ... -> width -> 10, ReLU between."""
    sizes = [NUM_FEATURES] + [width] * (depth - 1) + [NUM_CLASSES]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def parameter_count(width: int, depth: int) -> int:
    sizes = [NUM_FEATURES] + [width] * (depth - 1) + [NUM_CLASSES]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


@TASKS.register("deep-mlp")
def deep_mlp_task(*, seed: int = 0, width: int = 512, depth: int = 6) -> Task:
    """The digits task with ``depth`` linear layers of ``width`` units (default about 1.1M
    parameters; width 1024, depth 8: 6.4M).

    Raises:
        ConfigError: width or depth out of range.
    """
    for name, value, low, high in (("width", width, 16, 8192), ("depth", depth, 2, 64)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"task deep-mlp: {name} must be an integer in [{low}, {high}], "
                              f"got {value!r}")
    return dataclasses.replace(digits_task(seed=seed), name="deep-mlp",
                               build_model=lambda: build_deep_mlp(width, depth))
