"""The Strategy interface: how peers combine one flat tensor in one round."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch

from gossip.errors import ConfigError, ProtocolError, RejoinError
from gossip.registry import Registry
from gossip.transport import Message, Transport

STRATEGIES: Registry[Strategy] = Registry("strategy")


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
    #: ``synchronize`` raises on a NaN/Inf result itself, so the transport need not check
    #: every incoming frame of its kinds.
    checks_own_result: ClassVar[bool] = False

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

    @property
    def needs_every_peer(self) -> bool:
        """Every round needs every peer (an all-reduce): one dead peer stops it everywhere,
        so the transport stops its messages' waits as soon as any peer is known lost. Gossip
        strategies (``params``) carry on with the neighbours they have left."""
        return self.operates_on == "grads"

    # -- a training round, as the training loop runs it (defaults: blocking SGD) ----------
    def stop_requested(self, round: int) -> bool:
        """Whether this peer should stop computing mini-batches of ``round`` now (asked
        between mini-batches; never blocks). Blocking strategies compute them all."""
        return False

    def computed_all(self, round: int) -> None:
        """This peer computed every mini-batch of ``round``."""

    def average_gradients(self, total: torch.Tensor, count: int, round: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """Gradient strategies: the step direction from ``total``, the sum of this peer's
        gradients of ``count`` mini-batches (``total`` may be overwritten). By default the
        synchronized ``total / count``."""
        if count < 1:
            raise ConfigError(f"{type(self).__name__} averages the gradients of at least one "
                              f"mini-batch, got {count}")
        if count != 1:
            total.mul_(1.0 / count)
        return self.synchronize(total, round, out=out)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this strategy (residuals, public copies, ...)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def rejoin_round(self, rounds: Mapping[int, int]) -> int:
        """The round a peer restarted from a checkpoint resumes at, from the round each
        running peer is at (by rank). Strategies that cannot take a peer back raise."""
        raise RejoinError(f"rank {self.rank}: {type(self).__name__} cannot take a restarted "
                          f"peer back into a running job (dpsgd and matcha can); restart every "
                          f"peer with --resume instead, from checkpoints of one round")

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


class MixingGossip(Strategy):
    """A gossip strategy on the topology's static graph with its Metropolis-Hastings weights.

    Args:
        tag: Message kind, distinct per instance sharing one transport.
    """

    operates_on = "params"

    def __init__(self, *, rank, topology, transport, tag: str):
        super().__init__(rank=rank, topology=topology, transport=transport)
        self.tag = tag
        weights = topology.mixing_matrix()[rank]
        self.neighbors = topology.neighbors(rank)
        self.self_weight = float(weights[rank])
        self.weights = {j: float(weights[j]) for j in self.neighbors}

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.tag,)


def create_strategy(name: str, *, rank: int, topology, transport: Transport,
                    options: Mapping[str, Any] | None = None) -> Strategy:
    """Build a registered strategy; unknown names or options raise ConfigError naming them.

    Compression options (``compressor``, its own options such as ``density``, and the
    wrappers' ``error_feedback``, ``momentum``, ``clip_norm``, ``warmup_rounds``) become one
    Compressor handed to the strategy as ``compressor``.
    """
    factory = STRATEGIES.get(name)
    own, compression = split_options(name, options or {})
    if compression:
        own["compressor"] = build_compressor(**compression)
    return factory(rank=rank, topology=topology, transport=transport, **own)


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise ConfigError if ``options`` do not fit strategy ``name`` (or its compressor)."""
    _, compression = split_options(name, options)
    if compression:
        build_compressor(**compression)  # validates the compressor and its options


def split_options(name: str, options: Mapping[str, Any]) -> tuple[dict, dict]:
    """``options`` split into the strategy's own and the compressor's; ConfigError if an
    option belongs to neither, or compression is asked of a strategy that takes none."""
    allowed = strategy_options(name)
    own = {key: value for key, value in options.items() if key in allowed and key != "compressor"}
    rest = {key: value for key, value in options.items() if key not in own}
    compressor = rest.get("compressor")
    if compressor is None or compressor == "none" and len(rest) == 1:
        rest.pop("compressor", None)
        for key in rest:
            raise ConfigError(f"strategy {name!r} has no option {key!r}; options: "
                              f"{', '.join(allowed) or 'none'}"
                              + ("" if "compressor" not in allowed else
                                 " (compressor options need a compressor=...)"))
        return own, {}
    if "compressor" not in allowed:
        raise ConfigError(f"strategy {name!r} takes no compressor (it has its own "
                          f"sparsification: options {', '.join(allowed) or 'none'})")
    known = compression_options(compressor)
    for key in rest:
        if key not in known:
            raise ConfigError(f"strategy {name!r} with compressor {compressor!r} has no option "
                              f"{key!r}; options: {', '.join(sorted(set(allowed) | set(known)))}")
    return own, rest


def compression_options(compressor: str) -> list[str]:
    """Every option that configures ``compressor``: its own and its wrappers'."""
    from gossip.compress import build, compressor_options

    params = inspect.signature(build).parameters
    wrappers = [p for p, spec in params.items() if spec.kind == inspect.Parameter.KEYWORD_ONLY]
    return ["compressor", *wrappers, *compressor_options(compressor)]


def build_compressor(**options: Any):
    from gossip.compress import build

    options = dict(options)
    return build(options.pop("compressor"), **options)


def strategy_options(name: str) -> list[str]:
    params = inspect.signature(STRATEGIES.get(name)).parameters
    return [p for p in params if p not in ("rank", "topology", "transport")
            and params[p].kind == inspect.Parameter.KEYWORD_ONLY]
