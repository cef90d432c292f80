"""DiLoCo's outer optimizer (Douillard et al. 2023) and its streaming fragments (2025).

G is the model every peer agreed on at its last average, kept in fp32 (float64 stays
float64) and equal on every peer. At an average each peer sends its pseudo-gradient
``G - theta`` (global minus local: the other sign walks uphill, torchft#233), the inner
strategy returns their exact mean Delta, and SGD(lr, momentum, nesterov) steps G with
``G.grad = Delta``, as ``torch.optim.SGD`` would (dampening 0); theta becomes G. The inner
optimizer's state stays with each peer.

* lr 1 without momentum is plain averaging (``local`` without fragments then runs no outer
  state at all, bitwise as before).
* Before a slice's first average there is no agreed G (peers may even have started from
  different models): that average is a plain mean of theta, and G starts from it.
* Only the trainable parameters (the first ``parameters`` elements of a model's vector) take
  the outer step; the float buffers after them (BatchNorm's running statistics) are averaged
  plainly in the same message: an extrapolating step could push a running variance below 0.
* Streaming: the vector is cut into K contiguous slices (lengths differ by one at most);
  average number s (counted from the rounds, so the same on every peer) syncs slice s mod
  K. The vector is flat, with no layer layout, hence contiguous slices rather than the
  paper's strided layers; the early start of a slice's exchange (tau) is not done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from gossip.errors import ConfigError


class OuterSGD:
    """The outer state of one peer: G, the momentum, which slices have started.

    Args:
        lr, momentum, nesterov: The outer SGD's.
        fragments: K, the slices averaged in turn.
    """

    def __init__(self, *, lr: float, momentum: float, nesterov: bool, fragments: int = 1):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.fragments = fragments
        self.global_model: torch.Tensor | None = None  # G
        self.velocity: torch.Tensor | None = None  # the momentum buffer
        self.started = [False] * fragments

    def slice(self, fragment: int, numel: int) -> tuple[int, int]:
        """Fragment ``fragment``'s bounds ``(lo, hi)`` in a vector of ``numel`` elements
        (lengths differ by one at most, so peers of different lengths differ in one)."""
        return fragment * numel // self.fragments, (fragment + 1) * numel // self.fragments

    def average(self, x: torch.Tensor, fragment: int, parameters: int,
                mean: Callable[[torch.Tensor], torch.Tensor], dest: torch.Tensor) -> None:
        """Average fragment ``fragment`` of the flat ``x`` into ``dest`` (which may be
        ``x``) through ``mean`` (the inner strategy's exact mean, in place), stepping G on its
        first ``parameters`` elements; the rest of ``dest`` is ``x``."""
        self._fit(x, parameters)
        lo, hi = self.slice(fragment, x.numel())
        cut = max(lo, min(hi, parameters))  # [lo, cut): parameters, [cut, hi): buffers
        g = self.global_model[lo:cut]
        started = self.started[fragment]
        wire = torch.empty(hi - lo, dtype=self.global_model.dtype)
        if started:
            torch.sub(g, x[lo:cut], out=wire[:cut - lo])  # pseudo-gradient: global - local
        else:
            wire[:cut - lo].copy_(x[lo:cut])
        wire[cut - lo:hi - lo].copy_(x[cut:hi])
        wire = mean(wire)
        if started:
            self.step(g, wire[:cut - lo], self.velocity[lo:cut])
        else:
            g.copy_(wire[:cut - lo])
            # lr 1 without momentum (streaming local SGD) stays a plain mean, exactly
            self.started[fragment] = self.lr != 1 or self.momentum != 0
        if dest.data_ptr() != x.data_ptr():
            dest[:lo].copy_(x[:lo])
            dest[hi:].copy_(x[hi:])
        dest[lo:cut].copy_(g)
        dest[cut:hi].copy_(wire[cut - lo:hi - lo])

    def step(self, g: torch.Tensor, delta: torch.Tensor, velocity: torch.Tensor) -> None:
        """One SGD step of ``g`` along ``delta``, as torch.optim.SGD takes it."""
        if not self.momentum:
            g.add_(delta, alpha=-self.lr)
            return
        velocity.mul_(self.momentum).add_(delta)  # zeros at first: the first is delta
        direction = delta.add(velocity, alpha=self.momentum) if self.nesterov else velocity
        g.add_(direction, alpha=-self.lr)

    def _fit(self, x: torch.Tensor, parameters: int) -> None:
        """G and the momentum for a vector like ``x`` (made at the first average)."""
        if not 0 <= parameters <= x.numel():
            raise ConfigError(f"local: a model vector of {x.numel()} elements cannot start "
                              f"with {parameters} parameters")
        if self.global_model is None:
            dtype = torch.promote_types(x.dtype, torch.float32)
            self.global_model = torch.zeros(parameters, dtype=dtype)
            self.velocity = torch.zeros(parameters, dtype=dtype)
        elif self.global_model.numel() != parameters:
            raise ConfigError(f"local: the outer optimizer holds G of "
                              f"{self.global_model.numel()} parameters, now given "
                              f"{parameters} (the model must not change)")

    def state_dict(self) -> dict[str, Any]:
        """G, the momentum and the started slices (a checkpoint's)."""
        if self.global_model is None:
            return {"started": list(self.started)}
        return {"global_model": self.global_model.clone(), "velocity": self.velocity.clone(),
                "started": list(self.started)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        started = list(state.get("started", [False] * self.fragments))
        if len(started) != self.fragments:
            raise ConfigError(f"local: the checkpoint's outer state has {len(started)} "
                              f"fragments, this run {self.fragments}")
        self.started = started
        self.global_model = state.get("global_model")
        self.velocity = state.get("velocity")
        if self.global_model is not None:
            self.global_model = self.global_model.clone()
            self.velocity = self.velocity.clone()
