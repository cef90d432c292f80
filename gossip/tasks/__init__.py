"""Learning tasks (datasets + models), peer partitioning and evaluation.

Usage::

    task = create_task("digits", seed=0)
    shards = partition(task.train.y, num_peers, scheme="dirichlet", alpha=0.5)
    stream = BatchStream(task.train, shards[rank], batch_size=32, seed=rank)
"""

from gossip.tasks.base import (TASKS, BatchStream, Split, Task, create_task, evaluate,
                               task_factory)
from gossip.tasks.partition import SCHEMES, partition

# Imported for their registration side effect; they import sklearn lazily.
from gossip.tasks import digits as _digits  # noqa: F401  isort: skip
from gossip.tasks import wide as _wide  # noqa: F401  isort: skip
from gossip.tasks import deep as _deep  # noqa: F401  isort: skip

__all__ = [
    "SCHEMES",
    "TASKS",
    "BatchStream",
    "Split",
    "Task",
    "create_task",
    "evaluate",
    "partition",
    "task_factory",
]
