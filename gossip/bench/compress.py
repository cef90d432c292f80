"""`gossip bench compress`: every compressor on one tensor, timed side by side with torch.topk.

Reports per compressor the median compress and decompress time and the bytes on the wire
(msgpack header + frames, exactly what the codec sends) against the dense tensor, and for
top-k the ratio of our sampled selection to ``torch.topk`` measured interleaved in the same
run, with its recall against the exact top-k.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from gossip.bench.harness import format_table
from gossip.compress import create
from gossip.compress.base import Compressor, Payload, check_density
from gossip.compress.selection import topk_indices
from gossip.compress.sparse import k_for
from gossip.transport import Message, codec


def contenders(density: float, threshold: float) -> dict[str, Compressor]:
    """The compressors compared, by row label."""
    return {
        "none": create("none"),
        "fp16": create("fp16"),
        "bf16": create("bf16"),
        "topk exact": create("topk", density=density, method="exact"),
        "topk sampled": create("topk", density=density, method="sampled"),
        "randomk": create("randomk", density=density),
        "threshold": create("threshold", threshold=threshold),
        "qsgd (s=16)": create("qsgd", levels=16),
        "terngrad": create("terngrad"),
        "sign": create("sign"),
    }


def wire_bytes(p: Payload) -> int:
    """Bytes the codec puts on the socket for a message carrying ``p``."""
    header, frames = codec.encode(Message("bench", 0, meta=p.meta, buffers=p.buffers), 0)
    return len(header) + sum(f.numel() for f in frames)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def selection(x: torch.Tensor, k: int, reps: int) -> dict[str, float]:
    """torch.topk vs our sampled selection, interleaved rep by rep; recall vs exact top-k."""
    ours, theirs = [], []
    for rep in range(reps):
        theirs.append(median_ms(lambda: torch.topk(x.abs(), k, sorted=False), 1))
        gen = torch.Generator().manual_seed(rep)
        ours.append(median_ms(lambda gen=gen: topk_indices(x, k, generator=gen), 1))
    fast = topk_indices(x, k, generator=torch.Generator().manual_seed(reps))
    exact = torch.topk(x.abs(), k, sorted=False).indices
    hits = torch.isin(fast, exact).sum().item()
    return {"torch_topk_ms": statistics.median(theirs), "fast_ms": statistics.median(ours),
            "ratio": statistics.median(o / t for o, t in zip(ours, theirs)),
            "recall": hits / k if k else 1.0, "selected": fast.numel()}


def run(numel: int, density: float, *, reps: int = 5, seed: int = 0,
        echo: Callable[[str], None] = print) -> dict:
    """Benchmark every compressor on ``numel`` Gaussian float32; print and return results."""
    density = check_density(density)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    k = k_for(density, numel)
    dense = wire_bytes(create("none").compress(x))
    echo(f"{numel:,} float32 ({dense / 1e6:.1f} MB dense), density {density} (k = {k:,}), "
         f"{reps} reps, torch threads {torch.get_num_threads()}")
    sel = selection(x, k, reps)
    echo(f"selection: torch.topk(|x|) {sel['torch_topk_ms']:.1f} ms, ours (sampled) "
         f"{sel['fast_ms']:.1f} ms = {sel['ratio']:.3f}x, recall {sel['recall']:.4f}, "
         f"exactly k: {sel['selected'] == k}")
    # The k-th largest |x| makes threshold send about as much as top-k.
    threshold = float(torch.kthvalue(x.abs(), numel - k + 1).values) if k else 0.0
    rows = []
    for label, comp in contenders(density, threshold).items():
        payload = comp.compress(x, key="bench", round=0)
        compress_ms = median_ms(lambda c=comp: c.compress(x, key="bench", round=0), reps)
        decompress_ms = median_ms(lambda c=comp, p=payload: c.decompress(p), reps)
        size = wire_bytes(payload)
        rows.append({"compressor": label, "compress ms": compress_ms,
                     "x torch.topk": compress_ms / sel["torch_topk_ms"],
                     "decompress ms": decompress_ms, "wire bytes": size,
                     "x dense": size / dense})
    echo(format_table(rows, ["compressor", "compress ms", "x torch.topk", "decompress ms",
                             "wire bytes", "x dense"]))
    return {"selection": sel, "rows": rows, "dense_bytes": dense, "k": k}
