"""The ``resnet`` task: a ResNet-18 of the CIFAR layout on images that need no download.

The model: a 3x3 stem of 64 channels (no max-pool), four stages of two BasicBlocks (64, 128,
256, 512 channels, each times ``width``; stride 2 and a 1x1 shortcut entering stages 2-4),
global average pooling and a linear layer to 10 classes: 11,173,962 parameters at width 1,
701,466 at 0.25, 176,402 at 0.125.

BatchNorm stays: its running mean and variance are float buffers, so a parameter strategy
(dpsgd, local, ...) averages them with the weights (gossip.model_vector), while a gradient
strategy (ring-allreduce, ...) leaves each peer its own, measured on its own shard: every
peer then evaluates with its own statistics. The consensus probe averages the parameters
only; the average model it scores uses this peer's statistics.

The data (``data`` option):

* ``shapes`` (default): ten shapes (disk, ring, square, frame, triangle, plus, half-disk,
  bar, L, two dots) drawn at a random place, size and rotation, in a random colour on a
  random background, with Gaussian noise; generated from the seed, so any number of
  peers get a large set (10,000 training images) without a file. Random rotation and
  colour leave only the outline to learn, and a disk and a square differ by a few pixels
  at 16x16: on one peer, width 0.125, batch 32, lr 0.1, test accuracy passes 0.8 after
  250-350 steps and 0.9 after about 400 (measured; it swings by 0.1 between evaluations
  early on, as the BatchNorm statistics chase a fast-moving model).
* ``digits``: scikit-learn's bundled 8x8 digits (1,437 training images), upscaled
  bilinearly and repeated over 3 channels: real handwriting, but small and easy (a narrow
  net is above 0.95 within 300 steps).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gossip.errors import ConfigError
from gossip.options import Options, option
from gossip.tasks.base import TASKS, Split, Task
from gossip.tasks.cache import cached_arrays

NUM_CLASSES = 10
STAGES = (64, 128, 256, 512)
SHAPES = ("disk", "ring", "square", "frame", "triangle", "plus", "half-disk", "bar", "L",
          "two dots")
SHAPES_VERSION = 1  # bump when the drawing changes: it names the cached file


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (1x1 when the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def channels(width: float) -> tuple[int, ...]:
    """The four stages' channels at ``width`` (at least 1 each)."""
    return tuple(max(1, round(c * width)) for c in STAGES)


def build_resnet18(width: float = 1.0, classes: int = NUM_CLASSES) -> nn.Sequential:
    """ResNet-18 of the CIFAR layout, every stage's channels times ``width``; weights come
    from torch's global RNG."""
    widths = channels(width)
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                               nn.BatchNorm2d(widths[0]), nn.ReLU()]
    inputs = widths[0]
    for stage, outputs in enumerate(widths):
        for block in range(2):
            layers.append(BasicBlock(inputs, outputs, 2 if stage and not block else 1))
            inputs = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


def _width(value: float) -> str | None:
    return None if 1 / 64 <= value <= 4 else "must be in [1/64, 4]"


@dataclass(frozen=True)
class ResNetOptions(Options):
    """The ``resnet`` task's options (``--task-option KEY=VALUE``)."""

    width: float = option(0.25, "Channels of every stage times this (1: ResNet-18, 11.2M "
                                "parameters; 0.25: 0.70M; 0.125: 0.18M).", check=_width)
    size: int = option(16, "Image side in pixels.", choices=(16, 32))
    data: str = option("shapes", "Images: shapes (generated from the seed) or digits "
                                 "(scikit-learn's, upscaled).", choices=("shapes", "digits"))
    train_images: int = option(10_000, "Training images of shapes.",
                               check=lambda v: None if 100 <= v <= 200_000
                               else "must be in [100, 200000]")
    test_images: int = option(256, "Test images of shapes (every peer scores its model "
                                   "every round: 256 cost about 2.5 training steps of 32).",
                              check=lambda v: None if 10 <= v <= 50_000
                              else "must be in [10, 50000]")

    @classmethod
    def refusal(cls, name: str, value, why: str) -> ConfigError:
        return ConfigError(f"task resnet: {name} {why}, got {value!r}")


@TASKS.register("resnet")
def resnet_task(*, seed: int = 0, **options) -> Task:
    """ResNet-18 (CIFAR layout, ``width`` times its channels) on ``size`` x ``size`` colour
    images of ten classes: generated shapes or upscaled digits (the module's doc).

    Raises:
        ConfigError: an option unknown or out of range (one line naming it).
    """
    opts = ResNetOptions(**options)
    if opts.data == "shapes":
        x_tr, y_tr, x_te, y_te = _shapes(seed, opts.size, opts.train_images, opts.test_images)
    else:
        x_tr, y_tr, x_te, y_te = _digits(seed, opts.size)
    width = opts.width
    return Task(name="resnet", train=Split(x_tr, y_tr), test=Split(x_te, y_te),
                num_classes=NUM_CLASSES,
                build_model=lambda: build_resnet18(width),
                metadata={"data": opts.data, "size": opts.size, "width": width})


# -- data ---------------------------------------------------------------------------------


def _digits(seed: int, size: int) -> tuple[torch.Tensor, ...]:
    """The digits task's standardized split, upscaled bilinearly to ``size`` and repeated
    over three channels."""
    from gossip.tasks.digits import digits_task  # its split, cached as it caches it

    digits = digits_task(seed=seed)

    def images(x: torch.Tensor) -> torch.Tensor:
        small = x.reshape(-1, 1, 8, 8)
        big = F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False)
        return big.expand(-1, 3, -1, -1).contiguous()

    return images(digits.train.x), digits.train.y, images(digits.test.x), digits.test.y


@functools.lru_cache(maxsize=4)
def _shapes(seed: int, size: int, train: int, test: int) -> tuple[torch.Tensor, ...]:
    """Train and test shapes of ``seed`` (built once per machine, loaded once per process:
    a simulation builds the task once per peer)."""
    key = f"shapes{SHAPES_VERSION}-seed{seed}-{size}px-{train}-{test}"
    arrays = cached_arrays(key, lambda: {
        **dict(zip(("x_tr", "y_tr"), draw_shapes(train, size=size, seed=(seed, 0)))),
        **dict(zip(("x_te", "y_te"), draw_shapes(test, size=size, seed=(seed, 1))))})
    return tuple(torch.from_numpy(arrays[name]) for name in ("x_tr", "y_tr", "x_te", "y_te"))


def draw_shapes(n: int, *, size: int, seed) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (float32, ``(n, 3, size, size)``, about zero mean and unit variance)
    and their labels (int64, the index in ``SHAPES``, balanced), a pure function of its
    arguments."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % NUM_CLASSES)
    radius = rng.uniform(0.3, 0.45, n) * size  # a shape spans 60-90 % of the side
    margin = radius  # inside the frame (a rotated square reaches 1.13 radius: its corners may clip)
    cx = rng.uniform(margin, size - margin)
    cy = rng.uniform(margin, size - margin)
    angle = rng.uniform(0, 2 * math.pi, n)
    dark = rng.random(n) < 0.5
    low = rng.uniform(0.0, 0.3, (n, 3))
    high = rng.uniform(0.7, 1.0, (n, 3))
    fg = np.where(dark[:, None], low, high)
    bg = np.where(dark[:, None], high, low)
    noise = rng.normal(0.0, 0.05, (n, 3, size, size))

    pixel = np.arange(size) + 0.5
    dx = (pixel[None, None, :] - cx[:, None, None]) / radius[:, None, None]
    dy = (pixel[None, :, None] - cy[:, None, None]) / radius[:, None, None]
    cos, sin = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    u, v = cos * dx + sin * dy, cos * dy - sin * dx
    mask = np.zeros((n, size, size), dtype=bool)
    for label, inside in enumerate(_OUTLINES):
        rows = labels == label
        mask[rows] = inside(u[rows], v[rows])
    images = np.where(mask[:, None], fg[:, :, None, None], bg[:, :, None, None]) + noise
    return ((images - 0.5) / 0.3).astype(np.float32), labels.astype(np.int64)


def _two_dots(u, v):
    return ((u - 0.55) ** 2 + v ** 2 < 0.16) | ((u + 0.55) ** 2 + v ** 2 < 0.16)


# Inside of each shape in its own coordinates (radius 1, centred, unrotated), SHAPES' order.
_OUTLINES = (
    lambda u, v: u * u + v * v < 1,                                       # disk
    lambda u, v: (u * u + v * v < 1) & (u * u + v * v > 0.36),            # ring
    lambda u, v: np.maximum(abs(u), abs(v)) < 0.8,                        # square
    lambda u, v: (np.maximum(abs(u), abs(v)) < 0.85)
    & (np.maximum(abs(u), abs(v)) > 0.5),                                 # frame
    lambda u, v: (v > -0.5) & (v < 1 - math.sqrt(3) * abs(u)),            # triangle
    lambda u, v: ((abs(u) < 0.3) & (abs(v) < 1)) | ((abs(v) < 0.3) & (abs(u) < 1)),  # plus
    lambda u, v: (u * u + v * v < 1) & (v > 0),                           # half-disk
    lambda u, v: (abs(u) < 1) & (abs(v) < 0.28),                          # bar
    lambda u, v: ((abs(u) < 0.9) & (v > -0.9) & (v < -0.35))
    | ((u > -0.9) & (u < -0.35) & (abs(v) < 0.9)),                        # L
    _two_dots,                                                            # two dots
)
