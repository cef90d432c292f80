"""Stateful wrappers that keep what was not sent: error feedback and DGC momentum correction.

State is per ``key`` (one entry per tensor compressed, e.g. per parameter bucket), kept in the
input's dtype and flat, and exported with ``state_dict`` for checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gossip.compress.base import Compressor, Payload, flatten
from gossip.compress.wrappers import Wrapper
from gossip.errors import ConfigError


class ErrorFeedback(Wrapper):
    """Compress x + residual and keep what the payload misses as the next residual.

    ``compress(x, key)`` sends ``Q(c)`` with ``c = x + residual[key]`` and stores
    ``residual[key] = c − decompress(sent)``, so ``c == decompress(sent) + residual`` (to fp
    rounding): no mass is ever lost, it is only delayed (Stich et al. 2018; Karimireddy et al.
    2019 for sign).
    """

    def __init__(self, inner: Compressor):
        super().__init__(inner)
        self._residuals: dict[str, torch.Tensor] = {}

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        residual = self._residuals.get(key)
        if residual is None:
            corrected = flat.clone()
        else:
            _check_state(residual, flat, key)
            corrected = flat + residual
        sent = self.inner.compress(corrected.view(x.shape), key=key, round=round)
        # The payload may alias `corrected` (identity); never subtract from it in place then.
        residual = _unaliased(corrected, sent)
        self.inner.add_to(sent, residual, alpha=-1.0)
        self._residuals[key] = residual
        return sent

    def residual(self, key: str = "") -> torch.Tensor | None:
        """What is still owed for ``key`` (flat), or None before its first compress."""
        return self._residuals.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._residuals = {k: v.clone().reshape(-1) for k, v in state["residuals"].items()}
        self.inner.load_state_dict(state.get("inner", {}))


class MomentumCorrection(Wrapper):
    """Deep Gradient Compression's momentum correction and momentum factor masking.

    Per key: ``u = m·u + g`` (local momentum), ``v = v + u`` (accumulated velocity), send
    ``Q(v)``. Then the transmitted coordinates leave both buffers: for sparse payloads
    ``u[idx] = v[idx] = 0``; for dense ones ``v −= decompress(sent)`` and ``u`` is zeroed
    where the sent value is non-zero. ``v`` plays the role of the error-feedback residual, so
    do not also wrap in ErrorFeedback. The sum over rounds of what is sent is the momentum
    SGD update (Lin et al. 2018); with a dense, lossless inner compressor the masking clears
    the momentum every round (plain SGD): use the optimizer's momentum in that case.

    Args:
        inner: The compressor of the velocity, typically top-k.
        momentum: m, in [0, 1).
    """

    def __init__(self, inner: Compressor, momentum: float = 0.9):
        super().__init__(inner)
        if (not isinstance(momentum, (int, float)) or isinstance(momentum, bool)
                or not 0 <= momentum < 1):
            raise ConfigError(f"momentum must be a number in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self._momenta: dict[str, torch.Tensor] = {}
        self._velocities: dict[str, torch.Tensor] = {}

    def compress(self, x: torch.Tensor, *, key: str = "", round: int = 0) -> Payload:
        flat = flatten(x)
        u, v = self._momenta.get(key), self._velocities.get(key)
        if u is None or v is None:
            u, v = flat.clone(), flat.clone()
        else:
            _check_state(u, flat, key)
            u.mul_(self.momentum).add_(flat)
            v.add_(u)
        sent = self.inner.compress(v.view(x.shape), key=key, round=round)
        v = _unaliased(v, sent)
        if self.inner.sparse:
            idx = self.unpack(sent).indices
            u[idx] = 0
            v[idx] = 0
        else:
            dense = self.inner.decompress(sent).reshape(-1).to(v.dtype)
            u.masked_fill_(dense != 0, 0)
            v.sub_(dense)
        self._momenta[key], self._velocities[key] = u, v
        return sent

    def momentum_buffer(self, key: str = "") -> torch.Tensor | None:
        """u for ``key`` (flat), or None before its first compress."""
        return self._momenta.get(key)

    def velocity(self, key: str = "") -> torch.Tensor | None:
        """v for ``key`` (flat): what was accumulated and not sent yet."""
        return self._velocities.get(key)

    def state_dict(self) -> dict[str, Any]:
        return {"momenta": {k: t.clone() for k, t in self._momenta.items()},
                "velocities": {k: t.clone() for k, t in self._velocities.items()},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._momenta = {k: t.clone().reshape(-1) for k, t in state["momenta"].items()}
        self._velocities = {k: t.clone().reshape(-1) for k, t in state["velocities"].items()}
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"MomentumCorrection({self.inner!r}, momentum={self.momentum})"


def _check_state(state: torch.Tensor, flat: torch.Tensor, key: str) -> None:
    if state.numel() != flat.numel() or state.dtype != flat.dtype:
        raise ConfigError(f"key {key!r} was compressed before as {state.numel()} "
                         f"{state.dtype}, now {flat.numel()} {flat.dtype}")


def _unaliased(t: torch.Tensor, p: Payload) -> torch.Tensor:
    """``t``, or a copy if a payload buffer shares its memory."""
    ptr = t.untyped_storage().data_ptr()
    if any(b.untyped_storage().data_ptr() == ptr for b in p.buffers if b.numel()):
        return t.clone()
    return t
