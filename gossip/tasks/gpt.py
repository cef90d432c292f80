"""The ``gpt`` task: a GPT-style byte-level language model on the running interpreter's own
standard library, so the text needs no download and every machine with the same Python has
the same bytes.

The model: pre-LayerNorm blocks (causal self-attention through torch's
``scaled_dot_product_attention``, then a 4x MLP with GELU), learned positions, a final
LayerNorm, and a 256-entry byte embedding tied to the output layer.
L(12d^2 + 13d) + (256 + ctx)d parameters plus 2d for the final LayerNorm:

========  ===  ==  =====  ===  ===========
size      d    L   heads  ctx  parameters
========  ===  ==  =====  ===  ===========
small     128  4   4      128  842,496
full      384  8   6      256  14,393,088
========  ===  ==  =====  ===  ===========

The text: the ``*.py`` files of ``sysconfig``'s stdlib directory, sorted by relative path,
without the directories test, tests, idlelib, tkinter, lib2to3, turtledemo, ensurepip,
site-packages and config-* (the build's own, platform-specific); bytes are tokens. A file
is a test file when the first byte of sha256(its relative path) mod 10 is 0 (about one in
ten; CPython 3.11.7: 562 files, 10.6 MB, 59 of them test, 0.96 MB). Each split is its
files concatenated and cut into non-overlapping windows of ctx + 1 bytes: x the first
ctx, y the last ctx (the next byte at every position). The evaluation scores
``test_windows`` windows spread evenly over the test text: every peer scores its model
every round, so the default is small. The task's metadata records the Python version and
a sha256 of the files read (names and contents), to compare the data of two machines.

Metrics: the test loss in nats per byte, its perplexity e^loss, and next-byte accuracy.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gossip.errors import ConfigError
from gossip.options import Options, option
from gossip.tasks.base import TASKS, Split, Task, unlabelled
from gossip.tasks.cache import cached_arrays

VOCABULARY = 256
EXCLUDED = frozenset({"test", "tests", "idlelib", "tkinter", "lib2to3", "turtledemo",
                      "ensurepip", "site-packages"})
#: size -> (d, layers, heads, ctx)
SIZES = {"small": (128, 4, 4, 128), "full": (384, 8, 6, 256)}


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    """Bytes ``(batch, t <= ctx)`` (any integer dtype) -> next-byte logits
    ``(batch, t, 256)``."""

    def __init__(self, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, d)
        self.position = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        # GPT-2's initialization: small weights, residual projections scaled by depth so
        # the residual stream's variance does not grow with it.
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() > 1:
                deep = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(param, 0.0, 0.02 / math.sqrt(2 * layers) if deep else 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.long()  # the splits hold bytes as uint8
        h = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln(h), self.embed.weight)  # tied: the embedding reads out


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of ``(batch, t, 256)`` logits against the
    ``(batch, t)`` next bytes."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def parameter_count(d: int, layers: int, ctx: int) -> int:
    """The spec's L(12d^2 + 13d) + (256 + ctx)d, plus 2d for the final LayerNorm."""
    return layers * (12 * d * d + 13 * d) + (VOCABULARY + ctx) * d + 2 * d


def _ctx(value: int | None) -> str | None:
    return None if value is None or 8 <= value <= 4096 else "must be in [8, 4096]"


@dataclass(frozen=True)
class GPTOptions(Options):
    """The ``gpt`` task's options (``--task-option KEY=VALUE``)."""

    size: str = option("small", "small: d 128, 4 layers, 4 heads, ctx 128 (0.84M "
                                "parameters); full: d 384, 8 layers, 6 heads, ctx 256 (14.4M).",
                       choices=tuple(SIZES))
    ctx: int | None = option(None, "Context in bytes (default: the size's).", check=_ctx)
    test_windows: int = option(16, "Test windows scored (every peer scores its model every "
                                   "round: 16 of 128 cost about a training step of 8).",
                               check=lambda v: None if v >= 1 else "must be >= 1")

    @classmethod
    def refusal(cls, name: str, value, why: str) -> ConfigError:
        return ConfigError(f"task gpt: {name} {why}, got {value!r}")


@TASKS.register("gpt")
@unlabelled
def gpt_task(*, seed: int = 0, **options) -> Task:
    """A byte-level GPT on the interpreter's stdlib sources (the module's doc). ``seed`` is
    unused: the split is a rule on file names, the same for every seed.

    Raises:
        ConfigError: an option unknown or out of range (one line naming it), or no source
            files where the interpreter keeps its stdlib.
    """
    opts = GPTOptions(**options)
    d, layers, heads, default_ctx = SIZES[opts.size]
    ctx = opts.ctx or default_ctx
    corpus = stdlib_corpus()
    train = windows(corpus["train"], ctx)
    test = windows(corpus["test"], ctx)
    keep = np.unique(np.linspace(0, len(test) - 1, min(opts.test_windows, len(test))).round())
    test = Split(*(part[torch.from_numpy(keep.astype(np.int64))] for part in (test.x, test.y)))
    return Task(name="gpt", train=train, test=test, num_classes=VOCABULARY,
                build_model=lambda: ByteGPT(d, layers, heads, ctx), loss_fn=next_byte_loss,
                metrics=("test_loss", "perplexity", "accuracy"),
                metadata={"python": platform.python_version(), "size": opts.size, "ctx": ctx,
                          "files": int(corpus["files"]), "test_files": int(corpus["test_files"]),
                          "manifest_sha256": bytes(corpus["digest"]).hex()})


def windows(text: torch.Tensor, ctx: int) -> Split:
    """Non-overlapping windows of ``ctx + 1`` bytes of ``text`` as a split: x the first
    ``ctx``, y the next byte at each position. Both are views of ``text`` (no copy)."""
    n = (text.numel() - 1) // ctx
    if n < 1:
        raise ConfigError(f"task gpt: {text.numel()} bytes of text make no window of ctx {ctx}")
    return Split(text.as_strided((n, ctx), (ctx, 1)), text[1:].as_strided((n, ctx), (ctx, 1)))


# -- the text -----------------------------------------------------------------------------


def stdlib_files(root: Path | None = None) -> list[str]:
    """The relative paths of the stdlib's source files the task reads, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    paths = []
    for folder, dirs, files in os.walk(root):
        # pruned, not filtered after: site-packages alone may hold more than the stdlib
        dirs[:] = [d for d in dirs if d not in EXCLUDED and not d.startswith("config-")]
        base = Path(folder).relative_to(root)
        paths += [(base / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(paths)


def is_test_file(path: str) -> bool:
    """The test split's rule: the first byte of sha256(relative path) mod 10 is 0."""
    return hashlib.sha256(path.encode()).digest()[0] % 10 == 0


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> dict[str, torch.Tensor]:
    """The train and test text (uint8 tensors), the files' digest and counts: read once per
    machine (``cached_arrays``, keyed by the Python version and the files' names and
    sizes) and once per process."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = stdlib_files(root)
    if not paths:
        raise ConfigError(f"task gpt: no source files in {root}, the interpreter's stdlib")
    listing = "".join(f"{p}\t{(root / p).stat().st_size}\n" for p in paths)
    key = (f"stdlib-py{platform.python_version()}-"
           f"{hashlib.sha256(listing.encode()).hexdigest()[:16]}")
    arrays = cached_arrays(key, functools.partial(_read_corpus, root, paths))
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def _read_corpus(root: Path, paths: list[str]) -> dict[str, np.ndarray]:
    digest = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    for path in paths:
        data = (root / path).read_bytes()
        digest.update(path.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        parts[is_test_file(path)].append(data)

    def text(chunks: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()

    return {"train": text(parts[False]), "test": text(parts[True]),
            "digest": np.frombuffer(digest.digest(), dtype=np.uint8).copy(),
            "files": np.array(len(paths)), "test_files": np.array(len(parts[True]))}
