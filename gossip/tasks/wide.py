"""The ``digits-wide`` task: the digits data with an MLP whose hidden layer is 2048 wide
(155k parameters, 0.6 MB): a model whose exchange takes measurable time on a capped link
while its real compute stays tiny (the crossover experiment emulates the device time)."""

from __future__ import annotations

import dataclasses

from torch import nn

from gossip.tasks.base import TASKS, Task
from gossip.tasks.digits import NUM_CLASSES, NUM_FEATURES, digits_task

WIDE_HIDDEN = 2048


def build_wide_mlp() -> nn.Module:
    """MLP 64 -> 2048 -> ReLU -> 10; weights come from torch's global RNG."""
    return nn.Sequential(nn.Linear(NUM_FEATURES, WIDE_HIDDEN), nn.ReLU(),
                         nn.Linear(WIDE_HIDDEN, NUM_CLASSES))


@TASKS.register("digits-wide")
def digits_wide_task(*, seed: int = 0) -> Task:
    """The digits task (same split and preprocessing) with ``build_wide_mlp``."""
    return dataclasses.replace(digits_task(seed=seed), name="digits-wide",
                               build_model=build_wide_mlp)
