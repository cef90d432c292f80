"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): each weight matrix M (n x m) of the
gradient is sent as rank-r factors, through two exact ring all-reduces.

Per round, with this peer's residual e and the last round's Q (m x r), for every matrix:
M += e; P = M Q after Q is orthonormalized; P is averaged over the peers (ring one);
P is orthonormalized; Q = M^T P; Q and every dense tensor (vectors, matrices too small to
pay) are averaged (ring two); the result is M^ = P Q^T and e = M - M^ (the residual against
the global M^). The rings give every peer the same bits of P and Q, so M^ and the update
are the same everywhere. Q starts from a seed all peers share (seed, tag and matrix, step)
and is kept for the next round (warm start). The first ``start_iter`` rounds are a plain
ring mean.

``synchronize`` gets one flat vector: the tensors it holds and their shapes come from
``use_layout`` (``Peer.step`` and every overlap bucket call it). Without one, a tensor of
two or more dimensions is one matrix and a 1-D vector is a vector: sent dense, as vectors
are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gossip.errors import ConfigError
from gossip.strategies.base import Strategy
from gossip.strategies.ring.exact import RingAllReduce
from gossip.strategies.ring.lowrank import Block, blocks, first_factor, orthogonalize
from gossip.strategies.ring.options import PowerSGDOptions, RingOptions


class PowerSGD(Strategy):
    """Approximate mean of gradients whose weight matrices travel as rank-r factors P and Q,
    all-reduced by the exact ring, with error feedback; identical on every peer."""

    options_class = PowerSGDOptions
    operates_on = "grads"
    needs_every_peer = True
    checks_own_result = True  # both rings raise on a non-finite mean, on every peer

    def __init__(self, *, rank, topology, transport, options: PowerSGDOptions | None = None):
        super().__init__(rank=rank, topology=topology, transport=transport, options=options)
        self.tag = self.options.tag
        self.p_ring, self.q_ring = (
            RingAllReduce(rank=rank, topology=topology, transport=transport,
                          options=RingOptions(tag=f"{self.tag}.{which}")) for which in "pq")
        self.shapes: tuple[tuple[int, ...], ...] | None = None
        self.step = 0  # rounds synchronized, warm-up included
        self.errors: dict[int, torch.Tensor] = {}  # block index -> residual e
        self.factors: dict[int, torch.Tensor] = {}  # block index -> last Q

    def use_layout(self, shapes: Sequence[Sequence[int]]) -> None:
        shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        if shapes != self.shapes:  # another model: the residuals and factors are not its
            self.shapes = shapes
            self.errors.clear()
            self.factors.clear()

    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        if not x.is_floating_point():
            raise ConfigError(f"powersgd averages floating-point tensors, got {x.dtype}")
        flat, dest = x.reshape(-1), self._output(x, out)
        shapes = self.shapes if self.shapes is not None else (tuple(x.shape),)
        opts = self.options
        layout = blocks(shapes, flat.numel(), rank=opts.matrix_rank,
                        min_compression_rate=opts.min_compression_rate)
        step, self.step = self.step, self.step + 1
        low = [(i, b) for i, b in enumerate(layout) if b.rank]
        if step < opts.start_iter or not low:
            return self.q_ring.synchronize(flat, round, out=dest).view_as(x)
        dense = [b for b in layout if not b.rank]
        # Everything read from x is read before dest (which may alias it) is written.
        grads = {i: self._with_residual(i, flat, b) for i, b in low}
        ps = torch.empty(sum(b.rows * b.rank for _, b in low), dtype=flat.dtype)
        p_views = _split(ps, [(b.rows, b.rank) for _, b in low])
        for (i, b), p in zip(low, p_views):
            torch.matmul(grads[i], orthogonalize(self._factor(i, b, step, flat.dtype)), out=p)
        self.p_ring.synchronize(ps, round, out=ps)
        qs = torch.empty(sum(b.cols * b.rank for _, b in low)
                         + sum(b.stop - b.start for b in dense), dtype=flat.dtype)
        views = _split(qs, [(b.cols, b.rank) for _, b in low]
                       + [(b.stop - b.start,) for b in dense])
        q_views, d_views = views[:len(low)], views[len(low):]
        bases = [orthogonalize(p) for p in p_views]
        for (i, _), p, q in zip(low, bases, q_views):
            torch.matmul(grads[i].T, p, out=q)
        for b, d in zip(dense, d_views):
            d.copy_(flat[b.start:b.stop])
        self.q_ring.synchronize(qs, round, out=qs)
        for (i, b), p, q in zip(low, bases, q_views):
            approx = dest[b.start:b.stop].view(b.rows, b.cols)
            torch.matmul(p, q.T, out=approx)
            self.errors[i] = grads[i].sub_(approx)  # against the M^ every peer holds
            self.factors[i] = q.clone()
        for b, d in zip(dense, d_views):
            dest[b.start:b.stop].copy_(d)
        return dest.view_as(x)

    def _with_residual(self, i: int, flat: torch.Tensor, b: Block) -> torch.Tensor:
        """This round's matrix ``i`` plus what earlier rounds did not send (a new tensor)."""
        m = flat[b.start:b.stop].view(b.rows, b.cols)
        e = self.errors.get(i)
        fits = e is not None and e.shape == m.shape and e.dtype == m.dtype
        return m + e if fits else m.clone()

    def _factor(self, i: int, b: Block, step: int, dtype: torch.dtype) -> torch.Tensor:
        """The Q the power step starts from: the last round's (warm start) or a fresh one."""
        q = self.factors.get(i) if self.options.warm_start else None
        if q is None or q.shape != (b.cols, b.rank) or q.dtype != dtype:
            q = first_factor(self.options.seed, f"{self.tag}.{i}", step, b.cols, b.rank, dtype)
        return q

    def state_dict(self) -> dict[str, Any]:
        """The step count, the layout, and per matrix its residual e and last Q."""
        return {"step": self.step, "shapes": self.shapes,
                "errors": {str(i): e.clone() for i, e in self.errors.items()},
                "factors": {str(i): q.clone() for i, q in self.factors.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        shapes = state.get("shapes")
        self.shapes = None if shapes is None else tuple(tuple(s) for s in shapes)
        self.errors = {int(i): e.clone() for i, e in state.get("errors", {}).items()}
        self.factors = {int(i): q.clone() for i, q in state.get("factors", {}).items()}


def _split(buffer: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive views of ``buffer`` shaped as ``shapes``."""
    views, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(buffer[start:start + size].view(shape))
        start += size
    return views
