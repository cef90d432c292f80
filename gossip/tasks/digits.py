"""The ``digits`` task: scikit-learn's 8x8 handwritten digits with a small MLP.

Small enough (1797 images) that many peers fit in one machine and a run takes
seconds, yet not trivially separable, so convergence differences between gossip
strategies show up.
"""

from __future__ import annotations

import functools
from importlib import metadata

import numpy as np
import torch
from torch import nn

from gossip.tasks.base import TASKS, Split, Task
from gossip.tasks.cache import cached_arrays

NUM_FEATURES = 64
HIDDEN = 128
NUM_CLASSES = 10


def build_mlp() -> nn.Module:
    """MLP 64 -> 128 -> ReLU -> 10; weights come from torch's global RNG."""
    return nn.Sequential(nn.Linear(NUM_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, NUM_CLASSES))


@functools.lru_cache(maxsize=4)
def _arrays(seed: int) -> tuple[np.ndarray, ...]:
    """The standardized split of ``seed``, computed once per machine (``cached_arrays``) and
    loaded once per process: a simulation builds the task once per peer, and 1,000 copies
    of the data would be half a gigabyte. The tasks built from it share these arrays;
    nothing changes them in place."""
    key = f"digits-split{seed}-sklearn{metadata.version('scikit-learn')}"
    arrays = cached_arrays(key, functools.partial(_split, seed))
    return tuple(arrays[name] for name in ("x_tr", "y_tr", "x_te", "y_te"))


def _split(seed: int) -> dict[str, np.ndarray]:
    # Imported here: sklearn is slow to import and only this needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = data.data.astype(np.float32) / 16.0
    y = data.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0)
    std[std == 0] = 1.0  # border pixels are constant 0; leave them at 0, not NaN
    return {"x_tr": np.ascontiguousarray((x_tr - mean) / std), "y_tr": y_tr,
            "x_te": np.ascontiguousarray((x_te - mean) / std), "y_te": y_te}


@TASKS.register("digits")
def digits_task(*, seed: int = 0) -> Task:
    """Build the digits task.

    Pixels are scaled to [0, 1] then standardized with the train set's statistics
    (test statistics must not leak into preprocessing). The 80/20 split is stratified
    so both halves keep the class balance.

    Args:
        seed: Seeds the train/test split.

    Returns:
        The task, loss cross-entropy.
    """
    x_tr, y_tr, x_te, y_te = _arrays(seed)
    return Task(
        name="digits",
        train=Split(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
        test=Split(torch.from_numpy(x_te), torch.from_numpy(y_te)),
        num_classes=NUM_CLASSES,
        build_model=build_mlp,
    )
