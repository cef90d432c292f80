"""The Strategy interface: how peers combine one flat tensor in one round."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from gossip.errors import ConfigError, ProtocolError, RejoinError
from gossip.options import Options, TaggedOptions
from gossip.strategies.registry import StrategyRegistry
from gossip.transport import Message, Transport

STRATEGIES = StrategyRegistry()
#: The capabilities every Strategy declares as class attributes.
CAPABILITIES = ("operates_on", "exact_mean", "preserves_mean", "symmetric_exchange",
                "needs_every_peer",
                "survives_death", "mixes_on_views", "can_rejoin", "synchronous", "checks_own_result", "stops_rounds_early",
                "plans_rounds", "keeps_tensor", "serves_roles", "wraps")
#: The strategy a peer runs when none is named.
DEFAULT = "dpsgd"
#: An exact all-reduce mean over every peer (the consensus probe measures with it).
EXACT_MEAN = "ring-allreduce"
_BUCKET = re.compile(r"\.b[0-9]+$")


def bucket_tag(tag: str, index: int) -> str:
    """The tag of bucket ``index``'s instance of a strategy tagged ``tag`` (``Peer.attach``
    builds one instance per gradient bucket, each with its own message kinds)."""
    return f"{tag}.b{index}"


def base_tag(tag: str) -> str:
    """The tag ``bucket_tag`` made ``tag`` from (``tag`` itself if it is no bucket's): a
    rank that attached no model (a server only) has that instance alone."""
    return _BUCKET.sub("", tag)


@dataclass(frozen=True)
class RoundPlan:
    """What ``Peer.step`` does with a model in one round (``Strategy.round_plan``)."""

    #: ``"grads"``: average the gradients, then step; ``"params"``: step, then synchronize.
    operates_on: Literal["grads", "params"]
    #: Params: whether this round synchronizes at all (local SGD sends nothing in between).
    exchange: bool = True
    #: The optimizer's state at an exchange: ``keep`` it local, ``reset`` it (zero the
    #: momentum), or ``average`` it (the momentum buffers are synchronized with the model).
    optimizer_state: Literal["keep", "reset", "average"] = "keep"


class Strategy(ABC):
    """One synchronization algorithm, run by every peer on a flat tensor per round.

    Gradient strategies (``operates_on = "grads"``) return an (approximate) average over
    peers; gossip strategies (``"params"``) return this peer's mixed value.

    What other code needs to know about a strategy is a class attribute (a capability), never
    its name or type: see the attributes below. A subclass names its options dataclass in
    ``options_class`` and registers itself with ``@STRATEGIES.register(name)``.

    Args:
        rank: This peer's rank.
        topology: The peers and their graph.
        transport: An open transport for this rank.
        options: This strategy's options (default: ``options_class()``).
    """

    #: The dataclass of this strategy's options.
    options_class: ClassVar[type[Options]] = Options
    #: ``"grads"``: synchronize averages gradients before the optimizer steps; ``"params"``:
    #: the optimizer steps locally, then synchronize mixes the parameters.
    operates_on: ClassVar[Literal["grads", "params"]]
    #: synchronize returns the exact mean over all peers, the same on every peer.
    exact_mean: ClassVar[bool] = False
    #: A round leaves the peers' average unchanged (gossip with a doubly stochastic mix).
    preserves_mean: ClassVar[bool] = False
    #: Symmetric gossip in rounds: in each round a peer sends its model to each partner of
    #: the round and gets the partner's model of that round back, however it then mixes them
    #: (robust mixing keeps it; a rushing attacker waits for those models).
    symmetric_exchange: ClassVar[bool] = False
    #: Every round needs every peer (an all-reduce): one dead peer stops it everywhere, so
    #: the transport stops its messages' waits as soon as any peer is known lost.
    needs_every_peer: ClassVar[bool] = False
    #: In an elastic run (``Peer(elastic=True)``) the survivors of a death agree on a view
    #: without it and go on: ``regroup(slot, members, epoch)`` moves the strategy onto it,
    #: and a round it interrupted is adopted or redone (gossip/strategies/elastic.py).
    survives_death: ClassVar[bool] = False
    #: In an elastic run a gossip strategy mixes on the agreed views of the members: at a
    #: view's first round ``regroup(slot, members, epoch)`` rebuilds its graph and weights
    #: for them (``Topology.view_graph``, Metropolis-Hastings); a neighbour gone in between
    #: is dropped as without views (gossip/strategies/elastic_gossip.py). No round is adopted
    #: or redone: consensus is not bitwise.
    mixes_on_views: ClassVar[bool] = False
    #: A peer restarted from a checkpoint can rejoin a running job (``rejoin_round``).
    can_rejoin: ClassVar[bool] = False
    #: Peers run in lockstep rounds: a round waits for the neighbours' messages of it. An
    #: asynchronous strategy has no rounds: each peer runs to its own budget, ``poll`` and
    #: ``finish`` progress and end its exchanges (gossip/training/asynchronous.py).
    synchronous: ClassVar[bool] = True
    #: ``synchronize`` deals with NaN/Inf itself (raises on a non-finite result, or leaves
    #: non-finite inputs out: robust mixing), so the transport need not check every
    #: incoming frame of its kinds.
    checks_own_result: ClassVar[bool] = False
    #: The strategy decides at run time when a round's computation ends (``stop_requested``
    #: may say stop): its combine point is not known in advance, so it cannot be overlapped.
    stops_rounds_early: ClassVar[bool] = False
    #: ``round_plan`` varies from round to round (local SGD: local steps, averages, a
    #: gradient-averaging warm-up, optimizer state reset or averaged at an average).
    plans_rounds: ClassVar[bool] = False
    #: ``synchronize`` keeps the tensor it is given and moves it between calls (``poll``,
    #: ``finish``): a device tensor's host copy is then the model (gossip/device/staging.py).
    keeps_tensor: ClassVar[bool] = False
    #: It runs the topology's parameter-server roles (``servers:``): a rank that only
    #: serves answers the workers in ``serve``. Others send to every neighbour each round,
    #: so a topology with roles is refused for them (gossip/matrix.py).
    serves_roles: ClassVar[bool] = False
    #: It runs another registered strategy that does the combining, named by its options
    #: (``inner``, ``inner_options``); its options class decides which it accepts
    #: (``accepts_inner``) and most capabilities are the inner one's
    #: (gossip/strategies/wrapping.py).
    wraps: ClassVar[bool] = False

    def __init__(self, *, rank: int, topology, transport: Transport,
                 options: Options | None = None):
        self.rank = rank
        self.topology = topology
        self.transport = transport
        self.size = topology.size
        self.options = options if options is not None else self.options_class()

    @classmethod
    def capabilities_for(cls, options: Options) -> dict[str, Any]:
        """The capabilities an instance built with ``options`` has (wrappers take their
        inner strategy's)."""
        return {key: getattr(cls, key, None) for key in CAPABILITIES}

    @classmethod
    def traffic(cls, rank: int, size: int, numel: int, dtype: torch.dtype,
                options: Options) -> Iterable | None:
        """This rank's round as messages with sizes and no payloads (``Step``s, iterated once
        per round: a list, or a ``Plan`` making them as they go; gossip/strategies/traffic.py)
        for a tensor of ``numel`` elements, or None where the pattern depends on the values
        (the sizes-only simulation refuses those)."""
        return None

    @property
    def kinds(self) -> tuple[str, ...]:
        """Message kinds this strategy sends and expects: by default those its options name
        (``TaggedOptions.kinds``); a strategy whose options carry no tag says its own."""
        if not isinstance(self.options, TaggedOptions):
            raise ConfigError(f"{type(self).__name__}: declare its options on TaggedOptions "
                              f"or say its message kinds (kinds)")
        return self.options.kinds

    @abstractmethod
    def synchronize(self, x: torch.Tensor, round: int, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one round on ``x`` (contiguous, CPU) and return the result, shaped like ``x``.

        The result goes to ``out`` if given (which may be ``x`` itself: in place), else to a
        new tensor. ``x`` may be modified again as soon as this returns.
        """

    def use_layout(self, shapes: Sequence[Sequence[int]]) -> None:
        """From now on ``synchronize`` gets tensors of these shapes, flattened and
        concatenated in order (``Peer.step`` says so for a model's gradients, overlap for
        each bucket's). Ignored by default; a strategy that compresses weight matrices by
        shape (powersgd) keeps it."""

    def synchronize_model(self, x: torch.Tensor, round: int, *, parameters: int,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """``synchronize`` of a model's vector (``ModelVector``): its first ``parameters``
        elements are the trainable parameters, the rest float buffers (and momentum). By
        default the same; an outer optimizer (``local``'s) steps the parameters only."""
        return self.synchronize(x, round, out=out)

    # -- a training round, as the training loop runs it (defaults: blocking SGD) ----------
    def round_plan(self, round: int) -> RoundPlan:
        """How ``Peer.step`` treats the model in ``round``: by default as ``operates_on``
        says, every round (local SGD varies it)."""
        return RoundPlan(self.operates_on)

    def serve(self) -> None:
        """Work this peer owes the others after its own last round (a parameter server
        answering until every worker said goodbye); ``Peer`` runs it before it closes.
        Nothing by default."""

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

    # -- asynchronous strategies (``synchronous = False``) ----------------------------------
    def poll(self) -> None:
        """Progress exchanges under way without waiting (asked between mini-batches)."""

    def finish(self) -> None:
        """Before this peer leaves: complete what is under way and serve the neighbours
        until they are done too (``Peer`` calls it on a clean exit)."""

    def record_fields(self, round: int) -> dict[str, Any]:
        """Optional ``Record`` fields this strategy fills for ``round`` (e.g. the staleness
        it used); none by default, so the metrics lines of others stay as they are."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this strategy (residuals, public copies, ...)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def handover_state(self) -> dict[str, Any]:
        """What a peer joining an elastic run takes of this strategy's state from its donor
        (``take_handover``): nothing by default (error-feedback residuals are never copied:
        a copy would count the donor's unsent mass twice)."""
        return {}

    def take_handover(self, state: Mapping[str, Any]) -> None:
        """As a joiner: start from the donor's ``handover_state``."""

    def carried(self) -> tuple[torch.Tensor, ...]:
        """Elastic runs: what the result of the round completed last travels with to a
        member that adopts it (gossip/strategies/elastic.py); nothing by default."""
        return ()

    def adopted(self, round: int, carried: Sequence[torch.Tensor]) -> None:
        """Elastic runs: ``round`` was completed elsewhere and its result adopted here, with
        ``carried`` (the donor's ``carried()``): leave this strategy's state as its own
        completion would. By default the state the interrupted round left is that already
        (a residual that depends on this peer's input alone)."""

    def rejoin_round(self, rounds: Mapping[int, int]) -> int:
        """The round a peer restarted from a checkpoint resumes at, from the round each
        running peer is at (by rank). Strategies that cannot take a peer back raise."""
        able = STRATEGIES.where(can_rejoin=True)
        raise RejoinError(f"rank {self.rank}: {type(self).__name__} cannot take a restarted "
                          f"peer back into a running job ({' and '.join(able) or 'none'} "
                          f"can); restart every peer with --resume instead, from checkpoints "
                          f"of one round")

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
