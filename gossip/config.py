"""The resolved configuration of a training run: frozen, validated, YAML round-trippable."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gossip.attacks import Attacks
from gossip.errors import ConfigError
from gossip.faults import DelayConfig


@dataclass(frozen=True)
class TrainConfig:
    """What every peer of a run trains and how it synchronizes.

    Attributes:
        strategy: Registered strategy name.
        options: Strategy options (e.g. ``piece_bytes``).
        task: Registered task name (data + model).
        rounds: Optimizer steps per peer; each one synchronizes once.
        batch_size: Samples per local step (per peer and round).
        minibatches: The batch is computed as this many equal mini-batches whose gradients
            are accumulated (the same step as one batch); delays are injected per
            mini-batch, and the ``nonblocking`` strategy may stop a round early.
        lr: SGD learning rate; 0: no training step, the peers only mix their models
            (pure gossip, e.g. to measure how fast they reach consensus).
        momentum: SGD momentum (local to each peer).
        partition: ``iid`` or ``dirichlet`` split of the training data over peers.
        alpha: Dirichlet concentration (smaller is more skewed).
        seed: Seeds data split, model init and batches; equal on all peers.
        eval_every: Rounds between consensus measurements (and at the last round).
        timeout: Seconds to wait for any one message before giving up on a peer (a lockstep
            round's receive); waits that serve (ps, adpsgd) give up only after this long
            without a message or a heartbeat, so a busy peer is waited for.
        dead_after: Seconds a peer's connection may stay broken before the peer is declared
            dead (gossip drops it, all-reduce stops naming it); keep it below ``timeout``.
        checkpoint_every: Write this peer's checkpoint every this many rounds (0: never); a
            peer restarted with ``--resume`` rejoins from it. Also makes every peer keep its
            last few messages per neighbour, to re-send them to a restarted one.
        delays: Injected compute, straggler and send delays (see gossip.faults).
        attack: Attacking peers (see gossip.attacks): ``"RANK:KIND[,KEY=VALUE...]"``, a
            list of those, or a mapping rank -> kind.
        task_options: Keyword arguments of the task's factory (e.g. ``width``, ``depth`` of
            ``deep-mlp``).
        layer_delay: Emulated device: seconds each layer of the model sleeps in forward
            (twice that in backward), spread over the layers the way a GPU's compute is
            (``gossip.tasks.emulated``); 0: off.
        overlap: Overlap synchronization with computation (``Peer.attach``).
        bucket_mb: With ``overlap``: gradient bucket size in MiB (``.inf``: one bucket).
        budget_samples: An asynchronous strategy's peer also stops once it has trained on
            this many samples (0: no such limit; ``rounds`` always bounds it).
        budget_seconds: ... or once this many seconds of training have passed (0: none).
        snapshot_seconds: An asynchronous strategy's peers save their model every this many
            seconds of wall clock (and at the end) in the run directory's ``snapshots``, the
            consensus is measured from (gossip.training.snapshots); 0: no snapshots.
    """

    strategy: str = ""  # empty: the default strategy (gossip.strategies.DEFAULT)
    options: Mapping[str, Any] = field(default_factory=dict)
    task: str = "digits"
    rounds: int = 300
    batch_size: int = 32
    minibatches: int = 1
    lr: float = 0.1
    momentum: float = 0.9
    partition: str = "iid"
    alpha: float = 0.5
    seed: int = 0
    eval_every: int = 25
    timeout: float = 60.0
    dead_after: float = 5.0
    checkpoint_every: int = 0
    delays: DelayConfig = field(default_factory=DelayConfig)
    attack: Attacks = field(default_factory=Attacks)
    task_options: Mapping[str, Any] = field(default_factory=dict)
    layer_delay: float = 0.0
    overlap: bool = False
    bucket_mb: float = 4.0
    budget_samples: int = 0
    budget_seconds: float = 0.0
    snapshot_seconds: float = 2.0

    def __post_init__(self):
        from gossip.matrix import check_run
        from gossip.strategies import DEFAULT, STRATEGIES
        from gossip.tasks import SCHEMES, task_factory

        if not self.strategy:
            object.__setattr__(self, "strategy", DEFAULT)
        STRATEGIES.options(self.strategy, self.options)  # the name and every option checked
        task_factory(self.task)
        _require(self.rounds >= 1, "rounds", self.rounds, "must be >= 1")
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        _require(self.minibatches >= 1, "minibatches", self.minibatches, "must be >= 1")
        _require(self.batch_size % self.minibatches == 0, "batch_size", self.batch_size,
                 f"must be a multiple of minibatches ({self.minibatches})")
        _require(self.lr >= 0, "lr", self.lr, "must be >= 0 (0: pure gossip)")
        _require(0 <= self.momentum < 1, "momentum", self.momentum, "must be in [0, 1)")
        _require(self.partition in SCHEMES, "partition", self.partition,
                 f"must be one of {', '.join(SCHEMES)}")
        _require(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        _require(self.eval_every >= 1, "eval_every", self.eval_every, "must be >= 1")
        _require(self.timeout > 0, "timeout", self.timeout, "must be > 0")
        _require(self.dead_after > 0, "dead_after", self.dead_after, "must be > 0")
        _require(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every,
                 "must be >= 0 (0: no checkpoints)")
        _require(isinstance(self.delays, DelayConfig), "delays", self.delays,
                 "must be a DelayConfig")
        object.__setattr__(self, "attack", Attacks.parse(self.attack))
        _require(isinstance(self.task_options, Mapping), "task_options", self.task_options,
                 "must be a mapping")
        _require(self.layer_delay >= 0, "layer_delay", self.layer_delay, "must be >= 0")
        _require(isinstance(self.overlap, bool), "overlap", self.overlap, "must be true or false")
        _require(self.bucket_mb > 0, "bucket_mb", self.bucket_mb, "must be > 0 (MiB)")
        _require(self.budget_samples >= 0, "budget_samples", self.budget_samples,
                 "must be >= 0 (0: no limit)")
        _require(self.budget_seconds >= 0, "budget_seconds", self.budget_seconds,
                 "must be >= 0 (0: no limit)")
        _require(self.snapshot_seconds >= 0, "snapshot_seconds", self.snapshot_seconds,
                 "must be >= 0 (0: no snapshots)")
        check_run(self)  # overlap, budgets and checkpoints against the strategy

    @property
    def asynchronous(self) -> bool:
        """Whether the strategy runs without lockstep rounds: each peer counts its own steps
        (``Strategy.synchronous`` false)."""
        from gossip.matrix import capabilities

        return not capabilities(self.strategy, self.options)["synchronous"]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["options"] = dict(self.options)
        data["task_options"] = dict(self.task_options)
        data["delays"] = self.delays.to_dict()
        data["attack"] = self.attack.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"{source}: unknown field {key!r}; fields: {', '.join(known)}")
        values = {}
        for key, value in data.items():
            default = known[key].default
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ConfigError(f"{source}: {key}: expected a number, got {value!r}")
                value = type(default)(value)
            values[key] = value
        try:
            if "delays" in values:
                values["delays"] = DelayConfig.from_dict(values["delays"])
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        data = load_yaml(path)
        return cls.from_dict(data.get("train", data), source=str(path))


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from ``path``; errors name the file (and line)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {value!r} {rule}")
