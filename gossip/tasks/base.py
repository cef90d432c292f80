"""Task data types, the per-peer batch stream and evaluation.

A :class:`Task` bundles a dataset (already split and preprocessed, held as tensors
in memory), a model factory and a loss. The training loop only ever sees this
module's types, so new tasks plug in by registering a factory in :data:`TASKS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gossip.errors import ConfigError
from gossip.registry import Registry
from gossip.tasks.user import import_factory

# Factories take ``seed`` (keyword) and return a Task. Defined here rather than in
# ``gossip.tasks.__init__`` so task modules can register without a circular import.
TASKS: Registry[Task] = Registry("task")


@dataclass(frozen=True)
class Split:
    """One labelled set of examples.

    Attributes:
        x: Inputs, first dimension indexes examples: float32 features, or the bytes
            (uint8) of a text task's windows.
        y: Targets: class labels, int64, shape ``(len(x),)``; or a text task's next
            bytes, one per input position.
    """

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.shape[0] != self.y.shape[0]:
            raise ConfigError(
                f"split x has {self.x.shape[0]} examples but y has {self.y.shape[0]}"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Task:
    """A learning problem: data, a model factory and a loss.

    Attributes:
        name: Registry name of the task.
        train: Training examples (each peer trains on a shard of these).
        test: Held-out examples used by :func:`evaluate`.
        num_classes: Number of label classes (a byte-level text task: the 256 byte values).
        build_model: Returns a fresh model; deterministic once the caller has called
            ``torch.manual_seed`` (peers rely on this to start from identical weights).
        loss_fn: ``loss_fn(logits, labels) -> scalar mean loss``.
        metrics: The figures of an evaluation a round's record holds (``METRICS``):
            accuracy always; a language model adds its test loss and perplexity.
        metadata: What the data and model were made from, for the record (e.g. the
            interpreter's version and a hash of the files a text task read).
    """

    name: str
    train: Split
    test: Split
    num_classes: int
    build_model: Callable[[], torch.nn.Module]
    loss_fn: Callable = F.cross_entropy
    metrics: tuple[str, ...] = ("accuracy",)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown or "accuracy" not in self.metrics:
            raise ConfigError(f"task {self.name!r}: metrics must include accuracy and come "
                              f"from {', '.join(METRICS)}, got {', '.join(self.metrics)}")

    def scores(self, loss: float, accuracy: float) -> dict[str, float]:
        """Its ``metrics`` from an evaluation's mean loss and accuracy (``evaluate``)."""
        return {name: METRICS[name](loss, accuracy) for name in self.metrics}


#: What a task may report, from an evaluation's (mean loss, accuracy): the record fields.
METRICS: Mapping[str, Callable[[float, float], float]] = {
    "accuracy": lambda loss, accuracy: accuracy,
    "test_loss": lambda loss, accuracy: loss,  # nats per target: per byte for a text task
    "perplexity": lambda loss, accuracy: math.exp(min(loss, 700.0)),  # e^709 overflows
}


def unlabelled(factory: Callable) -> Callable:
    """Mark a task factory whose examples have no one class label each (a language
    model's targets are sequences), so that ``TrainConfig`` refuses label-based partitions
    and attacks before any task is built."""
    factory.labelled = False
    return factory


def factory_labelled(factory: Callable) -> bool:
    """Whether the tasks of ``factory`` have class labels (unless marked ``unlabelled``)."""
    return getattr(factory, "labelled", True)


def task_factory(name: str) -> Callable:
    """The factory of task ``name``: a registered name, or ``package.module:factory``.

    Raises:
        ConfigError: an unknown name (the message lists known tasks), or a path whose module
            or factory cannot be had.
    """
    return import_factory(name) if ":" in name else TASKS.get(name)


def create_task(name: str = "digits", *, seed: int = 0, **options) -> Task:
    """Build the task registered as ``name`` (or imported: ``package.module:factory``).

    Args:
        name: A name in :data:`TASKS`, or ``package.module:factory``.
        seed: Seeds the task's train/test split (not model initialisation).
        **options: The factory's own options (e.g. ``width``, ``depth``).

    Returns:
        The task.

    Raises:
        ConfigError: ``name`` is not registered (the message lists known tasks), cannot be
            imported, an option is unknown, or the factory returned no Task.
    """
    factory = task_factory(name)
    try:
        task = factory(seed=seed, **options)
    except TypeError as exc:
        raise ConfigError(f"task {name!r}: {exc}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"task {name!r}: the factory returned {type(task).__name__}, "
                          f"not a gossip.tasks.Task")
    return task


class BatchStream:
    """Infinite, seeded mini-batches over one peer's shard of a split.

    Every epoch visits the shard in a fresh seeded order. The last partial batch of
    an epoch is dropped so all batches have the same size (keeps per-step cost and
    gradient noise uniform across peers), unless the whole shard is smaller than
    ``batch_size``, in which case every batch is the whole shard, reshuffled.

    Attributes:
        epoch: 0-based index of the pass over the shard the last batch came from.
    """

    def __init__(self, split: Split, indices: np.ndarray, *, batch_size: int, seed: int):
        """Create the stream.

        Args:
            split: The split to draw from.
            indices: Indices into ``split`` forming this peer's shard.
            batch_size: Examples per batch, >= 1.
            seed: Seeds the shuffling; equal seeds give equal batch sequences.

        Raises:
            ConfigError: ``batch_size`` < 1, or ``indices`` is empty or out of range.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size == 0:
            raise ConfigError("indices must not be empty (a peer needs at least one example)")
        if indices.min() < 0 or indices.max() >= len(split):
            raise ConfigError(f"indices must lie in [0, {len(split)}), the split's size")
        self._split = split
        self._indices = indices
        self._rng = np.random.default_rng(seed)
        self._batch = min(batch_size, indices.size)
        self._order = self._rng.permutation(indices)
        self._pos = 0
        self.epoch = 0

    @property
    def batch_size(self) -> int:
        """Effective batch size (the shard size if that is smaller than requested)."""
        return self._batch

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in one pass over the shard."""
        return self._indices.size // self._batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the next ``(x, y)`` batch."""
        if self._pos + self._batch > self._order.size:
            self.epoch += 1
            self._order = self._rng.permutation(self._indices)
            self._pos = 0
        idx = torch.from_numpy(self._order[self._pos : self._pos + self._batch])
        self._pos += self._batch
        return self._split.x[idx], self._split.y[idx]

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    split: Split,
    loss_fn: Callable = F.cross_entropy,
    *,
    batch_size: int = 4096,
) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``split``: of its labels, or of every
    position's next byte for a text task (logits' last dimension is the class).

    The model is put in eval mode for the pass and its previous mode restored after,
    so calling this mid-training does not leave dropout/batch-norm switched off.

    Args:
        model: Maps ``split.x`` to logits of shape ``(n, num_classes)``.
        split: Examples to score; moved to the model's device batch by batch.
        loss_fn: ``loss_fn(logits, labels)`` returning the mean loss of a batch.
        batch_size: Targets per forward pass (bounds memory on large splits): examples
            of a classifier, this many bytes' worth of a text task's windows.

    Returns:
        ``(mean loss, accuracy in [0, 1])`` over all examples (all targets: every
        example has as many).

    Raises:
        ConfigError: ``split`` is empty.
    """
    n = len(split)
    if n == 0:
        raise ConfigError("cannot evaluate on an empty split")
    param = next(model.parameters(), None)
    device = param.device if param is not None else split.x.device
    was_training = model.training
    model.eval()
    try:
        loss_sum = 0.0
        correct = 0
        step = max(1, batch_size // split.y[0].numel())
        for start in range(0, n, step):
            x = split.x[start : start + step].to(device)
            y = split.y[start : start + step].to(device)
            logits = model(x)
            # loss_fn averages over the batch; re-weight so the result is a true mean.
            loss_sum += float(loss_fn(logits, y)) * y.shape[0]
            correct += int((logits.argmax(dim=-1) == y).sum())
        return loss_sum / n, correct / split.y.numel()
    finally:
        model.train(was_training)
