"""The Strategy interface: how peers combine one flat tensor in one round."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Mapping

import torch

from gossip.errors import ConfigError, ProtocolError
from gossip.registry import Registry
from gossip.transport import Message, Transport

STRATEGIES: Registry["Strategy"] = Registry("strategy")


class Strategy(ABC):
    """One synchronization algorithm, run by every peer on a flat tensor per round.

    Gradient strategies (``operates_on = "grads"``) return an (approximate) average over
    peers; gossip strategies (``"params"``) return this peer's mixed value.

    Args:
        rank: This peer's rank.
        topology: The peers and their graph.
        transport: An open transport for this rank.
    """

    operates_on: ClassVar[Literal["grads", "params"]]

    def __init__(self, *, rank: int, topology, transport: Transport):
        self.rank = rank
        self.topology = topology
        self.transport = transport
        self.size = topology.size

    @property
    @abstractmethod
    def kinds(self) -> tuple[str, ...]:
        """Message kinds this strategy sends and expects."""

    @abstractmethod
    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one round on ``x`` (contiguous, CPU) and return the result, shaped like ``x``.

        The result goes to ``out`` if given (which may be ``x`` itself: in place), else to a
        new tensor. ``x`` may be modified again as soon as this returns.
        """

    @staticmethod
    def _output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The flat destination tensor for a result shaped like ``x``."""
        if out is None:
            return torch.empty(x.numel(), dtype=x.dtype)
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ConfigError(f"out must be a contiguous {x.dtype} tensor of shape "
                              f"{tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
        return out.view(-1)

    def _expect(self, msg: Message, numel: int) -> torch.Tensor:
        """The single tensor of ``msg``, checked to hold ``numel`` elements."""
        if len(msg.buffers) != 1 or msg.buffers[0].numel() != numel:
            got = [b.numel() for b in msg.buffers]
            raise ProtocolError(
                f"rank {self.rank}: peer {msg.src} sent {msg.kind} round {msg.round} with "
                f"{got} elements, expected [{numel}] (do all peers synchronize tensors of the "
                f"same length?)"
            )
        return msg.buffers[0]


def create_strategy(name: str, *, rank: int, topology, transport: Transport,
                    options: Mapping[str, Any] | None = None) -> Strategy:
    """Build a registered strategy; unknown names or options raise ConfigError naming them."""
    factory = STRATEGIES.get(name)
    options = dict(options or {})
    check_options(name, options)
    return factory(rank=rank, topology=topology, transport=transport, **options)


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise ConfigError if ``options`` are not keyword options of strategy ``name``."""
    allowed = strategy_options(name)
    for key in options:
        if key not in allowed:
            raise ConfigError(f"strategy {name!r} has no option {key!r}; options: "
                              f"{', '.join(allowed) or 'none'}")


def strategy_options(name: str) -> list[str]:
    params = inspect.signature(STRATEGIES.get(name)).parameters
    return [p for p in params if p not in ("rank", "topology", "transport")
            and params[p].kind == inspect.Parameter.KEYWORD_ONLY]
