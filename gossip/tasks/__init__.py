"""Learning tasks (datasets + models), peer partitioning and evaluation.

Usage::

    task = create_task("digits", seed=0)
    shards = partition(task.train.y, num_peers, scheme="dirichlet", alpha=0.5)
    stream = BatchStream(task.train, shards[rank], batch_size=32, seed=rank)
"""

from gossip.tasks.base import (METRICS, TASKS, BatchStream, Split, Task, create_task, evaluate,
                               factory_labelled, task_factory, unlabelled)
from gossip.tasks.partition import SCHEMES, partition

# Imported for their registration side effect; they import sklearn lazily.
from gossip.tasks import digits as _digits  # noqa: F401  isort: skip
from gossip.tasks import wide as _wide  # noqa: F401  isort: skip
from gossip.tasks import deep as _deep  # noqa: F401  isort: skip
from gossip.tasks import resnet as _resnet  # noqa: F401  isort: skip
from gossip.tasks import gpt as _gpt  # noqa: F401  isort: skip

__all__ = [
    "METRICS",
    "SCHEMES",
    "TASKS",
    "BatchStream",
    "Split",
    "Task",
    "create_task",
    "evaluate",
    "factory_labelled",
    "partition",
    "task_factory",
    "unlabelled",
]
